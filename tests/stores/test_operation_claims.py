"""Operation claims on every store that keeps them: pods of one code share an operation, other
code is refused while a live claim names it, and a claim ends on release or lapses."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Route, Router
from starlette.types import Message

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    PostgresStore,
    RedisStore,
    StoreError,
    idempotent,
)
from starlette_idempotency import _claims as claims_module
from starlette_idempotency._claims import OperationClaims, ServedOperation, code_name
from starlette_idempotency.stores.base import OperationClaimingStore
from tests.support.conditions import eventually
from tests.support.stores import ClockedStore

LEDGER = ServedOperation("POST", "/v1/events/{kind}", "ledger.app:events")
NOTIFICATIONS = ServedOperation("POST", "/v1/events/{kind}", "notifications.app:events")


@pytest.fixture
def store(harness: ClockedStore) -> OperationClaimingStore:
    if not isinstance(harness.store, OperationClaimingStore):
        pytest.skip(f"{type(harness.store).__name__} keeps no operation claims")
    return harness.store


def claims(store: OperationClaimingStore, *served: ServedOperation) -> OperationClaims:
    return OperationClaims(store, served, timeout=5.0, where="the store under test")


async def test_other_code_is_refused_while_a_claim_names_it(store: OperationClaimingStore) -> None:
    ledger = claims(store, LEDGER)
    await ledger.start()
    try:
        with pytest.raises(ConfigurationError) as refused:
            await claims(store, NOTIFICATIONS).start()
        message = str(refused.value)
        assert "POST /v1/events/{kind} is guarded on the store under test" in message
        assert "by notifications.app:events here and by ledger.app:events" in message
        assert "their own key_prefix, or their own names" in message
        assert "@idempotent(operation='...')" in message
    finally:
        await ledger.stop()


async def test_pods_of_one_code_share_an_operation(store: OperationClaimingStore) -> None:
    pods = [claims(store, LEDGER), claims(store, LEDGER)]
    for pod in pods:
        await pod.start()
    await pods[0].stop()
    with pytest.raises(ConfigurationError):  # the other pod still serves it
        await claims(store, NOTIFICATIONS).start()
    await pods[1].stop()
    renamed = claims(store, NOTIFICATIONS)  # a rename, deployed once the old version stopped
    await renamed.start()
    await renamed.stop()


async def test_a_claim_that_is_not_renewed_lapses(
    store: OperationClaimingStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed without its shutdown: its claim lapses on the store's clock."""
    monkeypatch.setattr(claims_module, "CLAIM_TTL_SECONDS", 0.5)
    assert await store.claim_operation(LEDGER.label, LEDGER.code, "killed", 0.5) is None

    async def started() -> bool:
        new = claims(store, NOTIFICATIONS)
        try:
            await new.start()
        except ConfigurationError:
            return False
        await new.stop()
        return True

    assert not await started()
    await eventually(started, timeout=5.0, message="the killed holder's claim to lapse")


async def test_a_renewal_keeps_the_claim_and_release_ends_only_its_own(
    store: OperationClaimingStore,
) -> None:
    assert await store.claim_operation(LEDGER.label, LEDGER.code, "a", 30) is None
    assert await store.claim_operation(LEDGER.label, LEDGER.code, "b", 30) is None
    assert await store.claim_operation(LEDGER.label, LEDGER.code, "a", 30) is None  # renewed
    await store.release_operation(LEDGER.label, "a")
    assert await store.claim_operation(LEDGER.label, NOTIFICATIONS.code, "c", 30) == LEDGER.code
    await store.release_operation(LEDGER.label, "b")
    await store.release_operation(LEDGER.label, "nobody")
    assert await store.claim_operation(LEDGER.label, NOTIFICATIONS.code, "c", 30) is None
    await store.release_operation(LEDGER.label, "c")


async def test_two_codes_claiming_at_once_are_never_both_let_in(
    store: OperationClaimingStore,
) -> None:
    """Pods of two codes starting at the same instant: at most one code holds claims after
    (both may be refused), however their statements interleave."""
    for attempt in range(20):
        operation = f"POST /race/{attempt}"
        holders = [(f"h{n}", (LEDGER, NOTIFICATIONS)[n % 2].code) for n in range(8)]
        found = await asyncio.gather(
            *(store.claim_operation(operation, code, holder, 30) for holder, code in holders)
        )
        claimed = {code for (_, code), other in zip(holders, found, strict=True) if other is None}
        assert len(claimed) <= 1, (attempt, found)
        # A refused claimer names the other code.
        for (holder, code), other in zip(holders, found, strict=True):
            assert other in (None, *({LEDGER.code, NOTIFICATIONS.code} - {code}))
            await store.release_operation(operation, holder)


class Lifespan:
    """An app's lifespan driven as a server drives it: started, then shut down on exit."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self._messages: asyncio.Queue[Message] = asyncio.Queue()
        self.sent: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Lifespan:
        async def send(message: Message) -> None:
            self.sent.append(message["type"])

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.create_task(self.app(scope, self._messages.get, send))
        await self._messages.put({"type": "lifespan.startup"})
        await eventually(lambda: bool(self.sent), message="the startup's answer")
        if self.sent != ["lifespan.startup.complete"]:
            await asyncio.gather(self._task, return_exceptions=True)
            raise (self._task.exception() or AssertionError(self.sent))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._messages.put({"type": "lifespan.shutdown"})
        assert self._task is not None
        await self._task


def events_app(
    store: RedisStore | PostgresStore, name: str, shutdown: list[Any] | None = None
) -> Starlette:
    """A service serving ``POST /v1/events`` by a handler named ``name``, and ``POST /named``
    by one naming its operation; ``shutdown`` collects what its own shutdown finds claimed."""

    async def events(request: Request) -> Response:
        return JSONResponse({"handler": name}, status_code=201)

    events.__module__, _, events.__qualname__ = name.rpartition(":")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if shutdown is not None:  # what another service would find, once this one stops
            shutdown.append(await store.claim_operation(EVENTS, "probe:code", "probe", 30))
            await store.release_operation(EVENTS, "probe")

    app = Starlette(
        routes=[
            Route("/v1/events", idempotent()(events), methods=["POST"]),
            Route("/named", idempotent(operation="named")(events), methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


EVENTS = "POST /v1/events"


@pytest.mark.redis
async def test_an_app_claims_what_it_guards_and_ends_its_claims_before_its_shutdown(
    redis_url: str, redis_key_prefix: str
) -> None:
    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    shutdown: list[Any] = []
    async with Lifespan(events_app(store, "ledger.main:record", shutdown)):
        assert await store.claim_operation(EVENTS, "x:y", "probe", 30) == "ledger.main:record"
        # An operation it names is not claimed: the name is the identity.
        assert await store.claim_operation("POST named", "x:y", "probe", 30) is None
        assert await store.claim_operation("POST /named", "x:y", "probe", 30) is None
        with pytest.raises(ConfigurationError, match=r"by notifications\.main:send here and by"):
            async with Lifespan(events_app(store, "notifications.main:send")):
                pass
        async with Lifespan(events_app(store, "ledger.main:record")):  # another pod
            pass
    assert shutdown == [None]
    async with Lifespan(events_app(store, "notifications.main:send")):  # the old one stopped
        pass
    await store.aclose()


@pytest.mark.redis
async def test_an_app_starts_when_the_store_cannot_keep_its_claims(
    redis_url: str, redis_key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that refuses the claims (an ACL, say): the app starts, saying so."""
    store = RefusingClaims.from_url(redis_url, key_prefix=redis_key_prefix)
    async with Lifespan(events_app(store, "ledger.main:record")):
        assert "could not claim the guarded operations on redis at" in caplog.text
        assert "NOPERM" in caplog.text
    await store.aclose()


@pytest.mark.postgres
async def test_an_app_starts_on_a_schema_made_before_the_claims(
    postgres_dsn: str, postgres_table: str, sql: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A table migrated by an earlier version, the claims' table not made yet: the app starts,
    saying what to run, and claims nothing (other code is not refused) until it is made."""
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table)
    await store.create_schema()
    await sql.execute(f'DROP TABLE "{postgres_table}_operations"')
    async with Lifespan(events_app(store, "ledger.main:record")):
        assert "could not claim the guarded operations on postgres at" in caplog.text
        assert f'table "{postgres_table}_operations" (the operation claims)' in caplog.text
        assert "run `starlette-idempotency migrate`" in caplog.text
        # The startup check, as doctor, says so as well.
        assert f"check: table {postgres_table}_operations in " in caplog.text
        async with Lifespan(events_app(store, "notifications.main:send")):
            pass
    await store.aclose()


class RefusingClaims(RedisStore):
    async def claim_operation(self, operation: str, code: str, holder: str, ttl: float) -> None:
        raise StoreError("NOPERM this user has no permissions to access one of the keys")


def test_a_handler_is_named_alike_however_its_app_was_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def pay() -> None: ...

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    pay.__module__ = "__main__"
    main.__file__, main.__spec__ = "/srv/app/main.py", None  # python main.py
    assert code_name(pay) == "main:" + pay.__qualname__
    main.__spec__ = importlib.machinery.ModuleSpec("app.main", None)  # python -m app.main
    assert code_name(pay) == "app.main:" + pay.__qualname__
    pay.__module__ = "app.main"  # uvicorn app.main:app
    assert code_name(pay) == "app.main:" + pay.__qualname__


def hosted_app(store: RedisStore, host: str, name: str) -> Starlette:
    """``POST /op`` below ``Host(host)``, served by a handler named ``name``."""

    async def op(request: Request) -> Response:
        return JSONResponse({"handler": name}, status_code=201)

    op.__module__, _, op.__qualname__ = name.rpartition(":")
    route = Route("/op", idempotent()(op), methods=["POST"])
    app = Starlette(routes=[Host(host, Router([route]))])
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


@pytest.mark.redis
async def test_services_below_other_hosts_claim_apart(
    redis_url: str, redis_key_prefix: str
) -> None:
    """Their storage keys hold the host, and so do their claims: only a service below the
    same host pattern is refused."""
    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    async with (
        Lifespan(hosted_app(store, "{tenant}.shop.example", "shop.main:op")),
        Lifespan(hosted_app(store, "api.example", "api.main:op")),
    ):
        with pytest.raises(ConfigurationError, match=r"POST \{tenant\}\.shop\.example/op is"):
            async with Lifespan(hosted_app(store, "{tenant}.shop.example", "other.main:op")):
                pass
    await store.aclose()
