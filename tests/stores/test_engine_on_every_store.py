"""The middleware over every store backend: promises that hold on each of them alike."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    IdempotencyError,
    IdempotencyMiddleware,
    checkpoint,
    idempotency_context,
    idempotent,
    storage_key,
)
from starlette_idempotency.stores import RecordStatus
from starlette_idempotency.testing import FakeClock
from tests.support.guarded import make_client
from tests.support.stores import ClockedStore, require_recovery

HEADERS = {"Idempotency-Key": "order-1"}


async def test_a_checkpoint_after_the_response_is_refused_and_reopens_nothing(
    harness: ClockedStore,
) -> None:
    """A route answers 202 and records a recovery point in a background task, which runs
    after the response: the outcome is decided, so the checkpoint raises, and the stored
    response stays what a retry gets (it was turned back to InProgress: 409, then a second
    run once the lock expired)."""
    require_recovery(harness.store)
    refused: list[IdempotencyError] = []
    runs = 0

    async def provider_called(request: Request) -> None:
        try:
            await checkpoint(request, "provider_called", {"ref": "p_1"})
        except IdempotencyError as exc:
            refused.append(exc)

    @idempotent(lock_ttl_seconds=5)
    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        task = BackgroundTask(provider_called, request)
        return JSONResponse({"run": runs}, status_code=202, background=task)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=harness.store, clock=harness.now))

    first = await client.post("/pay", json={}, headers=HEADERS)

    assert first.status_code == 202
    [error] = refused
    assert "after the outcome" in str(error)
    record = await harness.store.get(storage_key("", "POST", "/pay", "order-1"))
    assert record is not None
    assert record.status is RecordStatus.COMPLETED
    assert record.checkpoints == ()
    retry = await client.post("/pay", json={}, headers=HEADERS)
    assert retry.status_code == 202
    assert retry.headers["x-idempotent-replay"] == "true"
    assert runs == 1


async def test_a_status_given_as_an_http_status_member_is_stored_and_replayed(
    harness: ClockedStore,
) -> None:
    """``JSONResponse(..., status_code=HTTPStatus.CREATED)`` and ``HTTPException(HTTPStatus...)``
    send an ``IntEnum``: MemoryStore could not pack it, the outcome was never stored, and the
    handler ran again once the lock expired."""
    runs = 0

    @idempotent(lock_ttl_seconds=5)
    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        if request.url.path == "/seat":
            raise HTTPException(HTTPStatus.CONFLICT, "taken")  # a 4xx: stored, never run again
        return JSONResponse({"run": runs}, status_code=HTTPStatus.CREATED)

    routes = [Route(path, pay, methods=["POST"]) for path in ("/pay", "/seat")]
    client = make_client(IdempotencyMiddleware(Starlette(routes=routes), store=harness.store))
    for path, status in (("/pay", 201), ("/seat", 409)):
        first = await client.post(path, json={}, headers=HEADERS)
        retry = await client.post(path, json={}, headers=HEADERS)
        assert (first.status_code, retry.status_code) == (status, status)
        assert retry.headers["x-idempotent-replay"] == "true"
        record = await harness.store.get(storage_key("", "POST", path, "order-1"))
        assert record is not None
        assert type(record.response_status_code) is int
    assert runs == 2


async def test_a_key_used_again_after_its_retention_starts_afresh(harness: ClockedStore) -> None:
    """A handler saved a recovery point and failed; its retention passed, and the client used
    the key for another charge. MemoryStore and PostgresStore handed the new request the old
    one's recovery points and fingerprint: it resumed from the other charge's point, its
    outcome was stored under the old fingerprint, and the old charge's retry was replayed the
    new one's answer. On Redis the key had simply gone."""
    require_recovery(harness.store)
    seen: list[tuple[int, str | None]] = []

    @idempotent(ttl_hours=1 / 3600, lock_ttl_seconds=0.5)
    async def charge(request: Request) -> Response:
        body = await request.json()
        seen.append((body["amount"], idempotency_context(request).recovered_from))
        if body.get("crash"):
            await checkpoint(request, "charged", {"amount": body["amount"]})
            raise RuntimeError("the pod dies after the charge")
        return JSONResponse({"charged": body["amount"]}, status_code=201)

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, store=harness.store, clock=harness.now)
    client = make_client(guarded, raise_app_exceptions=False)
    old = {"amount": 10, "crash": True}
    assert (await client.post("/charge", json=old, headers=HEADERS)).status_code == 500
    if isinstance(harness.now, FakeClock):
        harness.now.advance(5)  # with no read between: a read drops an expired record at once
    else:
        await harness.expire(storage_key("", "POST", "/charge", "order-1"), 1.0)

    new = await client.post("/charge", json={"amount": 99}, headers=HEADERS)
    retry = await client.post("/charge", json={"amount": 99}, headers=HEADERS)
    again = await client.post("/charge", json=old, headers=HEADERS)

    assert seen == [(10, None), (99, None)]
    assert (new.status_code, retry.status_code) == (201, 201)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert again.status_code == 422


async def test_a_dead_handler_is_recovered_across_a_fingerprint_version_bump(
    harness: ClockedStore,
) -> None:
    """A handler saved a recovery point and failed; a deploy changed the route's fingerprint
    version. Each store recovers only a record of the retry's own version, and the middleware
    answered every retry 202 requires_recovery until the retention ended. Now the retry
    recovers it as the same request (on_fingerprint_change="replay"), and the next replays."""
    require_recovery(harness.store)
    seen: list[tuple[str, str | None]] = []

    def release(version: str) -> Any:
        @idempotent(lock_ttl_seconds=5, fingerprint_version=version)
        async def pay(request: Request) -> Response:
            recovered_from = idempotency_context(request).recovered_from
            seen.append((version, recovered_from))
            if recovered_from is None:
                await checkpoint(request, "charged", {"ref": "ch_1"})
                return Response(b"provider down", status_code=503)
            return JSONResponse({"resumed_from": recovered_from}, status_code=201)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        return make_client(IdempotencyMiddleware(app, store=harness.store, clock=harness.now))

    old, new = release("1"), release("2")
    assert (await old.post("/pay", json={"a": 1}, headers=HEADERS)).status_code == 503

    retry = await new.post("/pay", json={"a": 1}, headers=HEADERS)
    again = await new.post("/pay", json={"a": 1}, headers=HEADERS)

    assert (retry.status_code, retry.json()) == (201, {"resumed_from": "charged"})
    assert seen == [("1", None), ("2", "charged")]
    assert again.status_code == 201
    assert again.headers["x-idempotent-replay"] == "true"
