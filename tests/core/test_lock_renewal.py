"""Lock renewal keeps a slow but alive handler's lock; a route may turn it off."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency.observability import IdempotencyEvent
from tests.support.conditions import eventually
from tests.support.guarded import make_client

LOCK_TTL = 0.3
ROOT = Path(__file__).parents[2]


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

    async def recording_renew(
        key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        renewed.append(f"{key}@{REQUEST_ID.get()}")
        return await renew(key, owner_token, lock_ttl, ttl=ttl)

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
    timer = middleware.renewals.timers.last
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
    """The handler blocks this event loop for longer than half its lock: once the loop runs
    again, a warning names the route and the blocked loop is counted. Nothing renews the lock
    meanwhile (no thread of the library's own): the warning says what keeps the effect once."""
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

    assert sink.timeouts == [("POST /compute", "event_loop_blocked")]
    [warning] = [r.getMessage() for r in caplog.records if r.name.endswith("_renewal")]
    assert "event loop was blocked" in warning
    assert "POST /compute" in warning
    assert "idempotency_transaction" in warning


async def test_a_loop_blocked_mid_handler_is_reported_when_it_runs_again() -> None:
    """The block ends while the handler still runs: the renewal timer's first check after it
    sees the gap and reports it, before the handler ends."""
    lock_ttl = 0.6
    blocked_and_back = asyncio.Event()
    sink = CountingSink()

    @idempotent(lock_ttl_seconds=lock_ttl)
    async def compute(request: Request) -> Response:
        await asyncio.sleep(0)
        time.sleep(lock_ttl * 0.7)  # noqa: ASYNC251 - blocks its loop, the case under test
        await blocked_and_back.wait()
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/compute", compute, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), metrics=sink))
    post = asyncio.create_task(client.post("/compute", headers={"Idempotency-Key": "k"}))
    await eventually(lambda: sink.timeouts, message="the blocked loop to be counted")
    assert not post.done()
    blocked_and_back.set()
    assert (await post).status_code == 200
    assert sink.timeouts == [("POST /compute", "event_loop_blocked")]


async def test_a_short_block_is_not_reported() -> None:
    sink = CountingSink()

    @idempotent(lock_ttl_seconds=3.0)
    async def compute(request: Request) -> Response:
        time.sleep(0.2)  # noqa: ASYNC251 - well under half the lock
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/compute", compute, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), metrics=sink))
    for n in range(3):
        assert (await client.post("/compute", headers={"Idempotency-Key": f"k{n}"})).is_success
    assert sink.timeouts == []


async def test_a_hung_handler_frees_its_key_after_max_processing_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handler that awaits for ever is renewed for max_processing_seconds, then its lock
    lapses one lock TTL later and a retry runs."""
    runs: list[str] = []
    never = asyncio.Event()
    sink = CountingSink()

    @idempotent(lock_ttl_seconds=LOCK_TTL, max_processing_seconds=2 * LOCK_TTL)
    async def hung(request: Request) -> Response:
        runs.append(request.headers["idempotency-key"])
        if len(runs) == 1:
            await never.wait()
        return JSONResponse({"run": len(runs)})

    app = Starlette(routes=[Route("/hung", hung, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), metrics=sink))
    headers = {"Idempotency-Key": "hung"}
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency._renewal"):
        first = asyncio.create_task(client.post("/hung", headers=headers))
        await eventually(lambda: runs, message="the first attempt to start")
        # Renewed past its lock TTL: a retry meanwhile is refused.
        await outlive_lock_ttl(1.5)
        assert (await client.post("/hung", headers=headers)).status_code == 409
        await eventually(lambda: sink.timeouts, message="renewal to end", timeout=5)
        assert sink.timeouts == [("POST /hung", "max_processing_seconds")]

        async def retry_runs() -> bool:
            return (await client.post("/hung", headers=headers)).status_code == 200

        await eventually(retry_runs, message="the key to be free for a retry", timeout=5)
    assert len(runs) == 2
    assert any("max_processing_seconds=0.6" in r.getMessage() for r in caplog.records)
    first.cancel()


async def test_max_processing_seconds_is_checked() -> None:
    from starlette_idempotency import ConfigurationError

    with pytest.raises(ConfigurationError, match="max_processing_seconds"):
        idempotent(max_processing_seconds=0)


THREADS_CHILD = """
import asyncio, threading, time
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client

@idempotent(lock_ttl_seconds=0.3)
async def slow(request):
    await asyncio.sleep(0.3)
    time.sleep(0.2)
    return JSONResponse({})

async def main():
    before = threading.active_count()
    app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    for n in range(3):
        assert (await client.post("/slow", headers={"Idempotency-Key": f"k{n}"})).is_success
    names = [t.name for t in threading.enumerate()]
    assert threading.active_count() == before, names

asyncio.run(main())
"""


def test_renewal_starts_no_thread() -> None:
    """Locks are renewed from the request's own loop: no thread of the library's own."""
    child = subprocess.run(
        [sys.executable, "-c", THREADS_CHILD], capture_output=True, timeout=60, cwd=ROOT
    )
    assert child.returncode == 0, child.stderr.decode()
