"""Lock renewal keeps a slow but alive handler's lock; a route may turn it off."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import subprocess
import sys
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._renewal import _THREAD, LockRenewal, LockWatchdog
from starlette_idempotency.observability import IdempotencyEvent
from tests.support.conditions import eventually
from tests.support.guarded import make_client

LOCK_TTL = 0.3


def build(
    renew: bool, runs: list[int], release: asyncio.Event, entered: list[asyncio.Event]
) -> object:
    @idempotent(lock_ttl_seconds=LOCK_TTL, renew_lock=renew)
    async def slow(request: Request) -> Response:
        runs.append(1)
        entered[len(runs) - 1].set()
        await release.wait()
        return JSONResponse({"n": len(runs)})

    app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])
    return IdempotencyMiddleware(app, store=MemoryStore())


async def outlive_lock_ttl(times: float) -> None:
    """Let real time pass: the condition under test is the lock's age itself."""
    deadline = time.monotonic() + LOCK_TTL * times
    while time.monotonic() < deadline:  # noqa: ASYNC110 - waiting on the clock, not an event
        await asyncio.sleep(LOCK_TTL / 10)


async def run_scenario(renew: bool) -> tuple[int, list[int]]:
    runs: list[int] = []
    release = asyncio.Event()
    entered = [asyncio.Event(), asyncio.Event()]
    client = make_client(build(renew, runs, release, entered))  # type: ignore[arg-type]
    headers = {"Idempotency-Key": "slow"}
    first = asyncio.create_task(client.post("/slow", headers=headers))
    async with asyncio.timeout(5):
        await entered[0].wait()
    await outlive_lock_ttl(3)
    duplicate = asyncio.create_task(client.post("/slow", headers=headers))
    if not renew:
        async with asyncio.timeout(5):
            await entered[1].wait()
    release.set()
    await first
    return (await duplicate).status_code, runs


async def test_renewal_keeps_a_slow_handler_exclusive() -> None:
    status, runs = await run_scenario(renew=True)
    assert status == 409
    assert len(runs) == 1


async def test_without_renewal_the_lock_lapses_and_a_retry_runs() -> None:
    status, runs = await run_scenario(renew=False)
    assert status == 200
    assert len(runs) == 2


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def renewal_recording_store(renewed: list[str]) -> MemoryStore:
    """A MemoryStore that appends the key of every lock renewal to ``renewed``, with the
    ``REQUEST_ID`` the renewal ran under (``key@request id``)."""
    store = MemoryStore()
    renew = store.renew

    async def recording_renew(key: str, owner_token: str, lock_ttl: float) -> bool:
        renewed.append(f"{key}@{REQUEST_ID.get()}")
        return await renew(key, owner_token, lock_ttl)

    store.renew = recording_renew  # type: ignore[method-assign]
    return store


async def test_short_handlers_leave_no_timer_behind() -> None:
    """Handlers shorter than a third of the TTL only pass through the loop's renewal timer:
    no renewal runs, nothing stays registered, and the timer disarms once they are done."""
    renewals: list[str] = []

    @idempotent(lock_ttl_seconds=LOCK_TTL)
    async def quick(request: Request) -> Response:
        return JSONResponse({"ok": True})

    store = renewal_recording_store(renewals)
    middleware = IdempotencyMiddleware(
        Starlette(routes=[Route("/quick", quick, methods=["POST"])]), store=store
    )
    client = make_client(middleware)
    responses = await asyncio.gather(
        *(client.post("/quick", headers={"Idempotency-Key": f"k{n}"}) for n in range(50))
    )

    assert {response.status_code for response in responses} == {200}
    timer = middleware.renewal_timers.last
    assert timer is not None
    assert not timer.entries
    await eventually(lambda: not timer.armed, message="the renewal timer to disarm")
    assert renewals == []


async def test_concurrent_slow_handlers_are_each_renewed() -> None:
    renewed: list[str] = []
    release = asyncio.Event()
    started: list[str] = []

    @idempotent(lock_ttl_seconds=LOCK_TTL)
    async def slow(request: Request) -> Response:
        started.append(request.headers["idempotency-key"])
        await release.wait()
        return JSONResponse({"ok": True})

    store = renewal_recording_store(renewed)
    guarded = IdempotencyMiddleware(
        Starlette(routes=[Route("/slow", slow, methods=["POST"])]), store=store
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # What tracing or log correlation does outside the middleware: a value per request.
        REQUEST_ID.set(dict(scope["headers"]).get(b"idempotency-key", b"").decode())
        await guarded(scope, receive, send)

    client = make_client(app)
    keys = [f"k{n}" for n in range(20)]
    posts = [
        asyncio.create_task(client.post("/slow", headers={"Idempotency-Key": k})) for k in keys
    ]
    await eventually(lambda: len(set(renewed)) == len(keys), message="every handler's lock renewed")
    release.set()
    assert {(await post).status_code for post in posts} == {200}
    # each renewal ran in its own request's context: key@request id with the same key twice
    assert {entry.rsplit(":", 1)[1] for entry in renewed} == {f"{k}@{k}" for k in keys}


class CountingSink:
    """A metrics sink that keeps the processing timeouts it is told about."""

    def __init__(self) -> None:
        self.timeouts: list[tuple[str, str]] = []

    def observe_event(self, event: IdempotencyEvent) -> None:
        pass

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        pass

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        self.timeouts.append((endpoint, reason))


async def test_a_blocked_loop_is_reported_with_its_route(caplog: pytest.LogCaptureFixture) -> None:
    """The handler blocks this event loop for longer than half its lock: the watchdog thread
    warns, naming the route, and the blocked loop is counted once it runs again. MemoryStore
    keeps its locks in this process, so the warning says they cannot be renewed from outside
    (RedisStore and PostgresStore are renewed: tests/stores/test_blocked_pods.py)."""
    lock_ttl = 0.6

    @idempotent(lock_ttl_seconds=lock_ttl)
    async def compute(request: Request) -> Response:
        # Blocks the event loop (the point here) for most of the lock, not past it.
        time.sleep(lock_ttl * 0.8)  # noqa: ASYNC251
        return JSONResponse({"ok": True})

    sink = CountingSink()
    app = Starlette(routes=[Route("/compute", compute, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), metrics=sink))

    with caplog.at_level(logging.WARNING, logger="starlette_idempotency._renewal"):
        response = await client.post("/compute", headers={"Idempotency-Key": "k"})
    assert response.status_code == 200
    await eventually(lambda: sink.timeouts, message="the blocked loop to be counted")

    assert sink.timeouts == [("POST /compute", "event_loop_blocked")]
    [warning] = [r.getMessage() for r in caplog.records if r.name.endswith("_renewal")]
    assert "event loop has been blocked" in warning
    assert "POST /compute" in warning
    assert "cannot be renewed outside the loop with MemoryStore" in warning


async def test_requests_with_gaps_between_them_do_not_wake_the_watchdog_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load the locks come and go between the watchdog's ticks. A thread that went idle
    at each gap would be woken by the next request, and each wake costs the event loop a
    hand-over of the GIL: the thread keeps ticking through gaps instead."""
    wakes: list[float] = []
    wake = _THREAD.wake

    def counted_wake() -> None:
        wakes.append(time.monotonic())
        wake()

    monkeypatch.setattr(_THREAD, "wake", counted_wake)

    @idempotent()
    async def quick(request: Request) -> Response:
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/quick", quick, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    for n in range(40):
        response = await client.post("/quick", headers={"Idempotency-Key": f"gap-{n}"})
        assert response.status_code == 200
        await asyncio.sleep(0.02)  # the gap: no lock is held until the next request

    assert len(wakes) <= 1


async def test_a_short_lock_is_looked_at_within_its_own_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handler that blocks its loop at once needs the watchdog before its lock lapses. The
    thread, ticking at its longest for the 30 s locks it saw last, is woken by a lock whose
    tick is shorter, rather than looking at it up to a quarter of a second later."""
    looks: list[tuple[str, float]] = []
    look_at = LockWatchdog.look_at

    def recorded(self: LockWatchdog, renewal: LockRenewal, now: float) -> None:
        looks.append((renewal.lock.endpoint, now))
        look_at(self, renewal, now)

    monkeypatch.setattr(LockWatchdog, "look_at", recorded)
    registered: dict[str, float] = {}

    @idempotent()
    async def usual(request: Request) -> Response:
        return JSONResponse({"ok": True})

    @idempotent(lock_ttl_seconds=0.2)
    async def blocking(request: Request) -> Response:
        registered[request.headers["idempotency-key"]] = time.monotonic()
        time.sleep(0.15)  # noqa: ASYNC251 - blocks its loop, the case under test
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/usual", usual, methods=["POST"]),
            Route("/blocking", blocking, methods=["POST"]),
        ]
    )
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    delays = []
    for n in range(5):
        await client.post("/usual", headers={"Idempotency-Key": f"usual-{n}"})
        key = f"blocking-{n}"
        assert (await client.post("/blocking", headers={"Idempotency-Key": key})).status_code == 200
        started = registered[key]
        later = [at for endpoint, at in looks if endpoint == "POST /blocking" and at >= started]
        delays.append(min(later, default=math.inf) - started)  # inf: never looked at

    assert max(delays) < 0.1, delays


FORKED_CHILD = """
import os, sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork() in a process with a thread
from starlette_idempotency._renewal import _THREAD
_THREAD._start()
assert _THREAD._thread is not None and _THREAD._thread.is_alive()
pid = os.fork()
if pid == 0:  # the child: the parent's thread did not come along, and a new one starts
    ok = _THREAD._thread is None
    _THREAD._start()
    os._exit(0 if ok and _THREAD._thread.is_alive() else 1)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_starts_a_watchdog_thread_of_its_own() -> None:
    """A worker forked after the watchdog thread started (a preloaded app) has no thread:
    it must start one, not believe the parent's runs."""
    child = subprocess.run([sys.executable, "-c", FORKED_CHILD], capture_output=True, timeout=30)
    assert child.returncode == 0, child.stderr.decode()
