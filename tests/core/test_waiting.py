"""on_in_progress="wait": duplicates wait for the first request and get its replay."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency.stores import AcquireResult, IdempotencyRecord
from tests.support.conditions import eventually
from tests.support.guarded import make_client

HEADERS = {"Idempotency-Key": "k"}


class CountingStore(MemoryStore):
    def __init__(self, *, notifies: bool = True) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.notifies = notifies

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.calls["try_acquire"] += 1
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)

    async def get(self, key: str) -> IdempotencyRecord | None:
        self.calls["get"] += 1
        return await super().get(key)

    def __getattribute__(self, name: str) -> Any:
        if name == "wait_for_change" and not object.__getattribute__(self, "notifies"):
            raise AttributeError(name)  # a store without notifications: waiters poll
        return object.__getattribute__(self, name)


class App:
    def __init__(
        self,
        store: MemoryStore,
        *,
        max_waiters: int = 1000,
        statuses: tuple[int, ...] = (201, 201),
        **options: Any,
    ) -> None:
        self.runs = 0
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

        @idempotent(on_in_progress="wait", **options)
        async def pay(request: Request) -> Response:
            self.runs += 1
            number = self.runs
            self.entered.set()
            await self.gate.wait()
            return JSONResponse({"n": number}, status_code=statuses[number - 1])

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        self.middleware = IdempotencyMiddleware(app, store=store, max_waiters=max_waiters)
        self.client = make_client(self.middleware)

    async def start_first(self) -> asyncio.Task[Any]:
        first = asyncio.create_task(self.client.post("/pay", json={}, headers=HEADERS))
        async with asyncio.timeout(5):
            await self.entered.wait()
        return first


async def test_duplicate_waits_and_gets_the_replay() -> None:
    for notifies in (True, False):
        app = App(CountingStore(notifies=notifies), wait_timeout_seconds=5)
        first = await app.start_first()
        duplicate = asyncio.create_task(app.client.post("/pay", json={}, headers=HEADERS))
        waiters = app.middleware.waiters
        await eventually(lambda: waiters.count == 1, message="the duplicate to wait")  # noqa: B023
        app.gate.set()
        assert (await first).json() == {"n": 1}
        replay = await duplicate
        assert replay.status_code == 201
        assert replay.json() == {"n": 1}
        assert replay.headers["x-idempotent-replay"] == "true"
        assert app.runs == 1


async def test_wait_times_out_with_409() -> None:
    app = App(MemoryStore(), wait_timeout_seconds=0.2)
    first = await app.start_first()
    duplicate = await app.client.post("/pay", json={}, headers=HEADERS)
    assert duplicate.status_code == 409
    assert int(duplicate.headers["retry-after"]) >= 1
    app.gate.set()
    await first


async def test_too_many_waiters_get_409_at_once() -> None:
    app = App(MemoryStore(), max_waiters=1, wait_timeout_seconds=5)
    first = await app.start_first()
    waiting = asyncio.create_task(app.client.post("/pay", json={}, headers=HEADERS))
    await eventually(lambda: app.middleware.waiters.count == 1)
    turned_away = await app.client.post("/pay", json={}, headers=HEADERS)
    assert turned_away.status_code == 409
    app.gate.set()
    await first
    assert (await waiting).status_code == 201


async def test_waiter_runs_itself_when_the_first_fails_transiently() -> None:
    app = App(MemoryStore(), statuses=(503, 201), wait_timeout_seconds=5)
    first = await app.start_first()
    duplicate = asyncio.create_task(app.client.post("/pay", json={}, headers=HEADERS))
    await eventually(lambda: app.middleware.waiters.count == 1, message="the duplicate to wait")
    app.gate.set()
    assert (await first).status_code == 503  # released: the waiter may run
    retried = await duplicate
    assert app.runs == 2
    assert retried.json() == {"n": 2}


async def test_a_thousand_waiters_cost_a_few_reads() -> None:
    store = CountingStore()
    app = App(store, wait_timeout_seconds=10)
    first = await app.start_first()
    duplicates = [
        asyncio.create_task(app.client.post("/pay", json={}, headers=HEADERS)) for _ in range(1000)
    ]
    await eventually(lambda: store.calls["try_acquire"] == 1001, timeout=20)
    reads_before = store.calls["get"]
    await asyncio.sleep(2.0)  # the waiting period being measured
    reads_while_waiting = store.calls["get"] - reads_before
    app.gate.set()
    await first
    responses = await asyncio.gather(*duplicates)
    assert {response.status_code for response in responses} == {201}
    assert app.runs == 1
    assert reads_while_waiting <= 6, reads_while_waiting
    assert store.calls["try_acquire"] == 1001  # waiters replay from the watcher's read


async def test_a_first_request_that_ends_before_the_watch_starts_is_seen_at_once() -> None:
    """The watch looks at the key before waiting for a notice: a completion that came before
    it subscribed sends no notice, and would otherwise be seen only at the 1 s poll."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
    from tests.support.guarded import make_client

    @idempotent(on_in_progress="wait")
    async def quick(request: Request) -> Response:
        await asyncio.sleep(0)  # one turn of the loop: the duplicate meets it in progress
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/quick", quick, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: ""))
    loop = asyncio.get_running_loop()
    started = loop.time()
    first, second = await asyncio.gather(
        *(client.post("/quick", headers={"Idempotency-Key": "k"}) for _ in range(2))
    )
    took = loop.time() - started
    assert {first.status_code, second.status_code} == {200}
    assert ["x-idempotent-replay" in r.headers for r in (first, second)].count(True) == 1
    assert took < 0.5, f"the waiting duplicate took {took:.2f}s: it missed the completion"


async def test_nothing_a_wait_made_outlives_its_request() -> None:
    """Soak: round after round of keys whose duplicates waited (answered with the replay,
    timed out, or cancelled by their client) leave no event in the store, no watch in the
    middleware and no task behind: the counts stay flat."""
    store = MemoryStore()
    gates: dict[str, asyncio.Event] = {}

    async def pay(request: Request) -> Response:
        await gates.setdefault(request.headers["idempotency-key"], asyncio.Event()).wait()
        return JSONResponse({"ok": True}, status_code=201)

    patient_pay = idempotent(on_in_progress="wait", wait_timeout_seconds=10)(pay)
    hasty_pay = idempotent(on_in_progress="wait", wait_timeout_seconds=0.05)(pay)
    routes = [
        Route("/patient", patient_pay, methods=["POST"]),
        Route("/hasty", hasty_pay, methods=["POST"]),
    ]
    middleware = IdempotencyMiddleware(Starlette(routes=routes), store=store)
    client = make_client(middleware)
    baseline_tasks = len(asyncio.all_tasks())

    def post(path: str, key: str) -> asyncio.Task[Any]:
        headers = {"Idempotency-Key": key}
        return asyncio.create_task(client.post(path, json={}, headers=headers))

    for round_number in range(10):
        keys = [f"r{round_number}-k{n}" for n in range(30)]
        firsts = [post("/patient", key) for key in keys] + [post("/hasty", key) for key in keys]
        await eventually(lambda: len(gates) == len(keys), message="every first request to run")  # noqa: B023
        patient = [post("/patient", key) for key in keys for _ in range(2)]
        hasty = [post("/hasty", key) for key in keys]
        doomed = [post("/patient", key) for key in keys]
        await eventually(
            lambda: middleware.waiters.count >= 3 * len(keys),  # noqa: B023
            message="the duplicates to wait",
        )
        for task in doomed:
            task.cancel()
        assert {response.status_code for response in await asyncio.gather(*hasty)} == {409}
        for key in keys:
            gates[key].set()
        responses = await asyncio.gather(*firsts, *patient)
        assert {response.status_code for response in responses} == {201}
        await asyncio.gather(*doomed, return_exceptions=True)
        gates.clear()

        await eventually(
            lambda: len(asyncio.all_tasks()) == baseline_tasks,
            message=f"round {round_number}: the watchers' tasks to end",
        )
        assert middleware.waiters.count == 0
        assert middleware.waiters._watches == {}
        assert store._changes == {}, f"round {round_number}: {len(store._changes)} events left"
