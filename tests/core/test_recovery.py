"""Recovery points: a retry after a crash sees what the dead attempt had done."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    MemoryStore,
    StoredResponse,
    checkpoint,
    idempotency_context,
    idempotent,
)
from starlette_idempotency._keys import storage_key
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency.stores import AcquireResult, IdempotencyRecord
from starlette_idempotency.testing import FakeClock
from tests.support.conditions import eventually
from tests.support.guarded import make_client
from tests.support.records import pending

HEADERS = {"Idempotency-Key": "order-1"}
LOCK_TTL = 5.0


class Provider:
    """A payment provider with its own idempotency reference."""

    def __init__(self) -> None:
        self.charges: dict[str, int] = {}

    def charge(self, reference: str, amount: int) -> None:
        self.charges.setdefault(reference, amount)

    def lookup(self, reference: str) -> int | None:
        return self.charges.get(reference)


class PaymentsApp:
    def __init__(self, store: MemoryStore, clock: FakeClock, **options: Any) -> None:
        self.provider = Provider()
        self.calls_to_provider = 0
        self.crash_after_charge = True
        self.reached_crash = asyncio.Event()
        self.recovered_from: list[str | None] = []

        @idempotent(lock_ttl_seconds=LOCK_TTL, renew_lock=False, **options)
        async def pay(request: Request) -> Response:
            context = idempotency_context(request)
            self.recovered_from.append(context.recovered_from)
            reference = f"ref-{context.key}"
            if context.recovered_from == "provider_charge_sent":
                charged = self.provider.lookup(context.recovery_data["providerRef"])
                if charged is not None:  # reconcile: it went through before the crash
                    return JSONResponse({"charged": charged, "reconciled": True}, status_code=201)
            await checkpoint(request, "provider_charge_sent", {"providerRef": reference})
            self.calls_to_provider += 1
            self.provider.charge(reference, 100)
            if self.crash_after_charge:
                self.reached_crash.set()
                await asyncio.Event().wait()  # the pod dies here, before the result is stored
            return JSONResponse({"charged": 100, "reconciled": False}, status_code=201)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        self.middleware = IdempotencyMiddleware(app, store=store, clock=clock)
        self.client = make_client(self.middleware)

    async def crash_first_attempt(self, clock: FakeClock) -> asyncio.Task[Any]:
        doomed = asyncio.create_task(
            self.client.post("/pay", json={"amount": 100}, headers=HEADERS)
        )
        async with asyncio.timeout(5):
            await self.reached_crash.wait()
        clock.advance(LOCK_TTL + 0.1)  # the lease runs out: the pod is gone
        self.crash_after_charge = False
        return doomed


def setup(**options: Any) -> tuple[PaymentsApp, MemoryStore, FakeClock]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    return PaymentsApp(store, clock, **options), store, clock


async def test_retry_after_a_crash_reconciles_instead_of_charging_again() -> None:
    app, _, clock = setup()
    doomed = await app.crash_first_attempt(clock)
    # before the lease is over a retry would get 409; after it, the retry recovers
    retry = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert retry.status_code == 201
    assert retry.json() == {"charged": 100, "reconciled": True}
    assert app.calls_to_provider == 1
    assert app.recovered_from == [None, "provider_charge_sent"]
    replay = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"
    doomed.cancel()


async def test_checkpointed_record_outlives_its_lock_ttl() -> None:
    app, store, clock = setup()
    doomed = await app.crash_first_attempt(clock)
    clock.advance(3600)  # long past the lock TTL, well within the retention time
    (record,) = store.records().values()
    assert record.checkpoints[0].name == "provider_charge_sent"
    assert record.checkpoints[0].data == {"providerRef": "ref-order-1"}
    doomed.cancel()


async def test_live_lease_still_answers_409() -> None:
    app, _, _ = setup()
    doomed = asyncio.create_task(app.client.post("/pay", json={"amount": 100}, headers=HEADERS))
    async with asyncio.timeout(5):
        await app.reached_crash.wait()
    busy = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert busy.status_code == 409
    doomed.cancel()


async def test_a_different_request_never_takes_over_a_checkpointed_key() -> None:
    app, _, clock = setup()
    doomed = await app.crash_first_attempt(clock)
    other = await app.client.post("/pay", json={"amount": 999}, headers=HEADERS)
    assert other.status_code == 422
    doomed.cancel()


async def test_hold_mode_answers_202_until_resolved() -> None:
    app, store, clock = setup(on_recovery="hold")
    doomed = await app.crash_first_attempt(clock)
    held = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert held.status_code == 202
    assert held.json()["status"] == "requires_recovery"
    assert held.json()["checkpoint"] == "provider_charge_sent"
    assert app.calls_to_provider == 1
    # an operator checks the provider and resolves the record
    key = storage_key("", "POST", "/pay", "order-1")
    resolved = StoredResponse(201, (("content-type", "application/json"),), b'{"charged":100}')
    assert await store.resolve(key, resolved)
    after = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert after.status_code == 201
    assert after.content == b'{"charged":100}'
    assert after.headers["x-idempotent-replay"] == "true"
    doomed.cancel()


async def charge_then_time_out(request: Request, attempts: list[str | None]) -> Response | None:
    """A handler's first step: it notes the point its attempt recovers from; a first attempt
    saves one as the provider's charge goes out, and answers 502 (the provider timed out); a
    recovery gets ``None``, to go on."""
    recovered_from = idempotency_context(request).recovered_from
    attempts.append(recovered_from)
    if recovered_from is not None:
        return None
    await checkpoint(request, "provider_charge_sent", {"providerRef": "r"})
    return JSONResponse({"error": "provider timed out"}, status_code=502)


async def test_failure_after_a_checkpoint_keeps_it_for_an_immediate_retry() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    attempts: list[str | None] = []

    @idempotent(lock_ttl_seconds=LOCK_TTL)
    async def pay(request: Request) -> Response:
        timed_out = await charge_then_time_out(request, attempts)
        return timed_out or JSONResponse({"reconciled": True})

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=store, clock=clock))
    assert (await client.post("/pay", json={}, headers=HEADERS)).status_code == 502
    retry = await client.post("/pay", json={}, headers=HEADERS)  # no wait for the lease
    assert retry.json() == {"reconciled": True}
    assert attempts == [None, "provider_charge_sent"]


async def test_checkpoint_needs_a_store_that_keeps_recovery_points() -> None:
    class PlainStore(MemoryStore):
        supports_recovery = False

    @idempotent()
    async def pay(request: Request) -> Response:
        await checkpoint(request, "step")
        return JSONResponse({})

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=PlainStore()))
    with pytest.raises(ConfigurationError, match="PlainStore cannot keep recovery points"):
        await client.post("/pay", json={}, headers=HEADERS)


def test_context_outside_a_guarded_request_is_an_error() -> None:
    from starlette_idempotency import IdempotencyError

    request = Request({"type": "http", "headers": []})
    with pytest.raises(IdempotencyError, match="not guarded"):
        idempotency_context(request)


class FirstProtocolStore(MemoryStore):
    """A store written for the protocol of 0.1: ``save_progress`` takes no lease (it reads
    ``record.locked_until``, an instant of the pod's clock), and ``try_acquire`` does not say
    whether a held record's lease ran out."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.leases: list[float] = []

    async def save_progress(  # type: ignore[override]
        self, key: str, record: IdempotencyRecord, ttl: float
    ) -> bool:
        assert record.locked_until is not None
        self.leases.append(record.locked_until)
        return await super().save_progress(key, record, ttl, record.locked_until - self._clock())

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        result = await super().try_acquire(key, pending, lock_ttl, recover=recover)
        return replace(result, lease_expired=None)


@pytest.mark.parametrize("on_recovery", ["handler", "hold"])
async def test_a_store_of_the_first_protocol_still_keeps_recovery_points(
    on_recovery: str,
) -> None:
    clock = FakeClock()
    store = FirstProtocolStore(clock)
    with pytest.warns(DeprecationWarning, match="save_progress takes no lease"):
        app = PaymentsApp(store, clock, on_recovery=on_recovery)
    doomed = await app.crash_first_attempt(clock)
    assert store.leases == [1_800_000_000.0 + LOCK_TTL]  # set on the middleware's clock

    retry = await app.client.post("/pay", json={"amount": 100}, headers=HEADERS)

    if on_recovery == "hold":
        assert retry.status_code == 202  # the lease judged on the middleware's clock
    else:
        assert retry.json() == {"charged": 100, "reconciled": True}
    doomed.cancel()


class RenewalCountingStore(MemoryStore):
    """A MemoryStore that counts lock renewals."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.renewals = 0

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        self.renewals += 1
        if ttl is None:  # not given (as before the store protocol had it)
            return await super().renew(key, owner_token, lock_ttl)
        return await super().renew(key, owner_token, lock_ttl, ttl=ttl)


async def test_a_recovery_late_in_the_retention_keeps_its_record_while_it_runs() -> None:
    """The handler died after its recovery point; a retry recovers the key ten seconds before
    the retention counted from that point ends, and runs on. Its renewals keep the record for
    the route's retention from then: a further retry gets 409, where it ran the handler afresh,
    without the recovery points, beside the recovered one."""
    clock = FakeClock()
    store = RenewalCountingStore(clock)
    attempts: list[str | None] = []
    finish = asyncio.Event()

    @idempotent(lock_ttl_seconds=0.3)  # renewed every 0.1 s of the loop's time
    async def pay(request: Request) -> Response:
        if timed_out := await charge_then_time_out(request, attempts):
            return timed_out
        await finish.wait()
        return JSONResponse({"reconciled": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=store, clock=clock))
    key = storage_key("", "POST", "/pay", "order-1")
    assert (await client.post("/pay", json={}, headers=HEADERS)).status_code == 502
    clock.advance(24 * 3600 - 10)
    recovered = asyncio.create_task(client.post("/pay", json={}, headers=HEADERS))
    await eventually(lambda: len(attempts) == 2, timeout=5, message="the recovery")
    await eventually(lambda: store.renewals >= 1, timeout=5, message="a renewal")

    clock.advance(3600)  # past the retention counted from the recovery point

    record = await store.get(key)
    assert record is not None, "the record went while its recovered handler ran"
    assert [point.name for point in record.checkpoints] == ["provider_charge_sent"]
    renewals = store.renewals
    await eventually(lambda: store.renewals > renewals, timeout=5, message="a renewal")
    busy = await client.post("/pay", json={}, headers=HEADERS)
    assert busy.status_code == 409
    finish.set()
    assert (await recovered).status_code == 201
    assert attempts == [None, "provider_charge_sent"]
    replay = await client.post("/pay", json={}, headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_a_renewal_passes_the_retention_to_a_store_whose_renew_takes_it() -> None:
    """The middleware's renewal hands the route's retention to a store whose ``renew`` takes
    ``ttl``, and renews a store written before it had the parameter as it did."""
    calls: list[tuple[str, float | None]] = []

    class TakesRetention(MemoryStore):
        async def renew(
            self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
        ) -> bool:
            calls.append((type(self).__name__, ttl))
            if ttl is None:
                return await super().renew(key, owner_token, lock_ttl)
            return await super().renew(key, owner_token, lock_ttl, ttl=ttl)

    class TakesNoRetention(MemoryStore):
        async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:  # type: ignore[override]
            calls.append((type(self).__name__, None))
            return await super().renew(key, owner_token, lock_ttl)

    class NamesItsLockTtlTtl(MemoryStore):
        """A store of the 0.2 protocol whose lock TTL is called ``ttl``: it was called with
        ``ttl=`` beside it, and every renewal failed with ``TypeError``."""

        async def renew(self, key: str, owner_token: str, ttl: float) -> bool:  # type: ignore[override]
            calls.append((type(self).__name__, None))
            return await super().renew(key, owner_token, ttl)

    for store in (TakesRetention(), TakesNoRetention(), NamesItsLockTtlTtl()):
        record = pending("k", "handler")
        assert (await store.try_acquire("k", record, LOCK_TTL)).acquired
        bounded = BoundedStore(store, timeout=1.0, metrics=None, tracer=None)
        assert await bounded.renew("k", record, LOCK_TTL, 3600.0)

    assert calls == [
        ("TakesRetention", 3600.0),
        ("TakesNoRetention", None),
        ("NamesItsLockTtlTtl", None),
    ]


async def test_a_recovery_late_in_the_retention_is_kept_should_its_handler_die_too() -> None:
    """A retry recovers the key ten seconds before the retention counted from the dead
    attempt's recovery point ends, and its pod dies too before any renewal. The record is kept
    for the route's retention from the recovery: the next retry recovers it again, with the
    recovery points, rather than run the handler afresh without them."""
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    attempts: list[str | None] = []
    dying = asyncio.Event()

    @idempotent(lock_ttl_seconds=LOCK_TTL, renew_lock=False)
    async def pay(request: Request) -> Response:
        if timed_out := await charge_then_time_out(request, attempts):
            return timed_out
        if len(attempts) == 2:
            dying.set()
            await asyncio.Event().wait()  # this pod dies too, its lease left to run out
        return JSONResponse({"reconciled": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=store, clock=clock))
    assert (await client.post("/pay", json={}, headers=HEADERS)).status_code == 502
    clock.advance(24 * 3600 - 10)
    doomed = asyncio.create_task(client.post("/pay", json={}, headers=HEADERS))
    async with asyncio.timeout(5):
        await dying.wait()

    clock.advance(LOCK_TTL + 60)  # past its lease, and the retention from the first point

    retry = await client.post("/pay", json={}, headers=HEADERS)
    assert retry.status_code == 201
    assert attempts == [None, "provider_charge_sent", "provider_charge_sent"]
    doomed.cancel()


class DeployedPayments:
    """A route that saves a recovery point and fails (version "1"), deployed again with another
    fingerprint version that reconciles from the point: one store and one clock across both."""

    def __init__(self, **options: Any) -> None:
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock)
        self.recovered_from: list[str | None] = []
        self.options = options

    def release(self, version: str, **options: Any) -> Any:
        @idempotent(lock_ttl_seconds=LOCK_TTL, fingerprint_version=version, **options)
        async def pay(request: Request) -> Response:
            context = idempotency_context(request)
            self.recovered_from.append(context.recovered_from)
            if context.recovered_from == "provider_charge_sent":
                return JSONResponse({"reconciled": context.recovery_data}, status_code=201)
            await checkpoint(request, "provider_charge_sent", {"providerRef": "r"})
            return JSONResponse({"error": "provider timed out"}, status_code=502)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        return make_client(IdempotencyMiddleware(app, store=self.store, clock=self.clock))

    async def died_before_the_deploy(self, **options: Any) -> Any:
        """The first attempt saves its point and fails under version "1" (which ends its lease
        at once); the client of the release of version "2" with ``options``."""
        old = self.release("1", **options)
        assert (await old.post("/pay", json={"amount": 100}, headers=HEADERS)).status_code == 502
        return self.release("2", **options)


# The body changed too: under on_fingerprint_change="replay" the key is trusted across versions.
@pytest.mark.parametrize("body", [{"amount": 100}, {"amount": 100, "currency": "EUR"}])
async def test_a_retry_after_a_fingerprint_version_bump_recovers_the_dead_handler(
    body: dict[str, Any],
) -> None:
    """The stores recover only a record of the retry's own fingerprint version, and the
    middleware answered each retry 202 requires_recovery (as if on_recovery="hold") until the
    retention ended, though nothing reconciles the record under on_recovery="handler"."""
    deployed = DeployedPayments()
    new = await deployed.died_before_the_deploy()

    retry = await new.post("/pay", json=body, headers=HEADERS)

    assert retry.status_code == 201
    assert retry.json() == {"reconciled": {"providerRef": "r"}}
    assert deployed.recovered_from == [None, "provider_charge_sent"]
    # stored as the request it recovered: later retries of the new version are replays
    (record,) = deployed.store.records().values()
    assert record.fingerprint_version.endswith(".1")
    again = await new.post("/pay", json=body, headers=HEADERS)
    assert again.status_code == 201
    assert again.headers["x-idempotent-replay"] == "true"
    assert again.json() == retry.json()
    assert len(deployed.recovered_from) == 2


@pytest.mark.parametrize(
    ("options", "status"),
    [({"on_fingerprint_change": "reject"}, 422), ({"on_recovery": "hold"}, 202)],
)
async def test_a_fingerprint_version_bump_keeps_reject_and_hold(
    options: dict[str, Any], status: int
) -> None:
    deployed = DeployedPayments()
    new = await deployed.died_before_the_deploy(**options)
    for _ in range(2):
        retry = await new.post("/pay", json={"amount": 100}, headers=HEADERS)
        assert retry.status_code == status
    assert deployed.recovered_from == [None]
    (record,) = deployed.store.records().values()
    assert record.checkpoints[0].name == "provider_charge_sent"


async def test_a_fingerprint_version_bump_never_takes_over_a_live_lease() -> None:
    """The record of the version before holds a lease still running (on the store's clock):
    a retry of the new version gets the 409, and takes it over only once the lease is out."""
    app, store, clock = setup(fingerprint_version="1")
    doomed = asyncio.create_task(app.client.post("/pay", json={"amount": 100}, headers=HEADERS))
    async with asyncio.timeout(5):
        await app.reached_crash.wait()
    new = PaymentsApp(store, clock, fingerprint_version="2")
    new.provider = app.provider

    busy = await new.client.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert busy.status_code == 409
    clock.advance(LOCK_TTL + 0.1)  # the pod is gone
    retry = await new.client.post("/pay", json={"amount": 100}, headers=HEADERS)

    assert retry.status_code == 201
    assert retry.json() == {"charged": 100, "reconciled": True}
    assert app.calls_to_provider + new.calls_to_provider == 1
    doomed.cancel()


async def test_a_dead_handler_of_the_routes_own_version_is_no_other_requests() -> None:
    """Only a record of another fingerprint version is recovered whatever its fingerprint: one
    of the route's own version is recovered by its own request only, and another request with
    the key is a 422."""
    deployed = DeployedPayments()
    new = deployed.release("2")
    first = await new.post("/pay", json={"amount": 100}, headers=HEADERS)
    assert first.status_code == 502
    other = await new.post("/pay", json={"amount": 999}, headers=HEADERS)
    assert other.status_code == 422
    assert deployed.recovered_from == [None]
