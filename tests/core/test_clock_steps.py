"""A step of the wall clock (an NTP correction, a VM resumed from a pause) while a request runs
on ``MemoryStore``: locks, leases and TTLs are measured on a monotonic clock, so the step
expires nothing and no duplicate runs the handler a second time.

The first tests step the real ``time.time`` of this process (the store and the middleware on
their default clocks); the last one a ``FakeClock``'s wall time alone (``jump``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    IdempotencyMiddleware,
    MemoryStore,
    checkpoint,
    idempotency_context,
    idempotent,
)
from starlette_idempotency.testing import FakeClock
from tests.support.guarded import make_client

HEADERS = {"Idempotency-Key": "order-1"}
LOCK_TTL = 5.0
STEP = 3600.0


class SteppedApp:
    """A route that runs until released, with a recovery point or without, on ``store``."""

    def __init__(self, store: MemoryStore, **middleware_options: Any) -> None:
        self.runs = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

        async def pay(request: Request) -> Response:
            self.runs += 1
            if self.runs > 1:  # a second run answers at once, for the test to see it
                recovered = idempotency_context(request).recovered_from is not None
                return JSONResponse({"recovered": recovered}, status_code=201)
            if request.url.path != "/plain":
                await checkpoint(request, "provider_called")
            self.entered.set()
            await self.release.wait()
            return JSONResponse({"recovered": False}, status_code=201)

        routes = [
            Route("/plain", idempotent(lock_ttl_seconds=LOCK_TTL)(pay), methods=["POST"]),
            Route("/recover", idempotent(lock_ttl_seconds=LOCK_TTL)(pay), methods=["POST"]),
            Route(
                "/hold",
                idempotent(lock_ttl_seconds=LOCK_TTL, on_recovery="hold")(pay),
                methods=["POST"],
            ),
        ]
        app = Starlette(routes=routes)
        self.client = make_client(IdempotencyMiddleware(app, store=store, **middleware_options))

    async def step_while_running(self, path: str, step: Callable[[], None]) -> None:
        """Start the first request, step the clock while it runs, and check that a duplicate
        is answered 409, then gets the replay."""
        first = asyncio.create_task(self.client.post(path, json={}, headers=HEADERS))
        async with asyncio.timeout(5):
            await self.entered.wait()
        step()
        duplicate = await self.client.post(path, json={}, headers=HEADERS)
        assert duplicate.status_code == 409, f"{path}: {duplicate.status_code} {duplicate.text}"
        self.release.set()
        assert (await first).json() == {"recovered": False}
        replay = await self.client.post(path, json={}, headers=HEADERS)
        assert replay.headers["x-idempotent-replay"] == "true"
        assert self.runs == 1


@pytest.mark.parametrize("path", ["/plain", "/recover", "/hold"])
async def test_a_forward_step_of_the_system_clock_expires_no_lock(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    app = SteppedApp(MemoryStore())

    def step() -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + STEP)

    await app.step_while_running(path, step)


@pytest.mark.parametrize("path", ["/plain", "/recover", "/hold"])
async def test_a_fake_clocks_jump_expires_no_lock(path: str) -> None:
    clock = FakeClock()
    app = SteppedApp(MemoryStore(clock=clock), clock=clock)

    await app.step_while_running(path, lambda: clock.jump(STEP))


async def test_time_that_passes_still_expires_a_lock() -> None:
    """The monotonic clock still measures: a lock whose TTL has passed is free again."""
    clock = FakeClock()
    app = SteppedApp(MemoryStore(clock=clock), clock=clock)
    first = asyncio.create_task(app.client.post("/recover", json={}, headers=HEADERS))
    async with asyncio.timeout(5):
        await app.entered.wait()
    clock.advance(LOCK_TTL + 0.1)  # renewals were due but never ran: the pod is gone

    retry = await app.client.post("/recover", json={}, headers=HEADERS)

    assert retry.json() == {"recovered": True}
    assert app.runs == 2
    first.cancel()
