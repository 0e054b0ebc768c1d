"""Keys appear in logs only as ``log_keys`` says: under ``"hashed"`` no log record of the
library (message, arguments, extra fields) holds the key, on any path that names one: events,
store failures (whose messages name the storage key), a lost lock, a failed renewal, a failed
release. Under ``"raw"`` (the default) the same paths do name the key, which shows they log."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores import AcquireResult, FencedWrite, IdempotencyRecord
from tests.support.conditions import eventually
from tests.support.guarded import make_client

SECRET = "order-7731-ann@example.com"  # a key that says too much


class NamingStore(MemoryStore):
    """Fails the chosen operations as real stores do: a StoreError naming the storage key,
    caused by the driver's error."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing
        self.renewals = 0

    def _fail(self, operation: str, key: str) -> None:
        if operation in self.failing:
            try:
                raise ConnectionError("Connection refused")
            except ConnectionError as exc:
                raise StoreError(f"redis {operation} failed for key {key!r}: {exc}") from exc

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self._fail("try_acquire", key)
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        self._fail("finish", key)
        if "lose" in self.failing:
            return FencedWrite.LOST
        return await super().finish(key, record, ttl)

    async def release(self, key: str, owner_token: str) -> bool:
        self._fail("release", key)
        return await super().release(key, owner_token)

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        self.renewals += 1
        self._fail("renew", key)
        return await super().renew(key, owner_token, lock_ttl, ttl=ttl)


async def post(
    store: NamingStore, log_keys: str, headers: dict[str, str], options: dict[str, Any]
) -> int:
    @idempotent(**options)
    async def pay(request: Request) -> Response:
        if request.headers.get("x-slow"):
            await eventually(lambda: store.renewals > 0, timeout=5, message="a renewal")
        return JSONResponse({}, status_code=int(request.headers.get("x-status", "201")))

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    middleware = IdempotencyMiddleware(app, store=store, log_keys=log_keys)  # type: ignore[arg-type]
    async with make_client(middleware) as client:
        sent = {"Idempotency-Key": SECRET, **headers}
        response = await client.post("/pay", json={}, headers=sent)
    return response.status_code


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """Everything the library's log records carry, as text."""
    return "\n".join(
        f"{record.getMessage()} {vars(record)}"
        for record in caplog.records
        if record.name.startswith("starlette_idempotency")
    )


# (what fails, the request's headers, the route's options)
PATHS: dict[str, tuple[set[str], dict[str, str], dict[str, Any]]] = {
    "store down, fail closed": ({"try_acquire"}, {}, {}),
    "store down, fail open": ({"try_acquire"}, {}, {"on_store_error": "fail_open"}),
    "response not stored": ({"finish"}, {}, {}),
    "lock lost": ({"lose"}, {}, {}),
    "release failed": ({"release"}, {"x-status": "500"}, {}),
    "renewal failed": ({"renew"}, {"x-slow": "1"}, {"lock_ttl_seconds": 0.3}),
}


@pytest.mark.parametrize("log_keys", ["raw", "hashed"])
@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
async def test_keys_are_logged_only_as_log_keys_says(
    path: tuple[set[str], dict[str, str], dict[str, Any]],
    log_keys: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing, headers, options = path
    caplog.set_level(logging.DEBUG, logger="starlette_idempotency")
    await post(NamingStore(failing), log_keys, headers, options)
    text = logged(caplog)
    assert "Connection refused" in text or failing == {"lose"}  # the cause stays visible
    if log_keys == "hashed":
        assert SECRET not in text
        assert "sha256:" in text
    else:
        assert SECRET in text
