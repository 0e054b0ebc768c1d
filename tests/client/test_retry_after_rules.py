"""The server's ``Retry-After`` rule and the client's, against each other.

A real guarded app (through ``httpx.ASGITransport``) whose first request is slow, and an
``AsyncIdempotentTransport`` sending a duplicate with the same key. Server and client share one
fake clock: the client's sleeps advance it, and the first request finishes once the clock
reaches its end, so the test measures in fake seconds how late the duplicate got its answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency.client import AsyncIdempotentTransport
from starlette_idempotency.testing import FakeClock

KEY = {"Idempotency-Key": "order-1"}
# Longer than any run below in fake time: the lock renews on the event loop's real clock,
# which does not move here, so the fake clock must never reach the lock's end.
LOCK_TTL = 600.0


@dataclass
class SlowPayment:
    """A guarded route whose first request takes ``duration`` fake seconds."""

    duration: float
    clock: FakeClock = field(default_factory=FakeClock)
    executions: int = 0
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    ends_at: float = 0.0
    retry_afters: list[str] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)

    def app(self) -> Starlette:
        @idempotent(lock_ttl_seconds=LOCK_TTL)
        async def pay(request: Request) -> Response:
            self.executions += 1
            self.ends_at = self.clock.now + self.duration
            self.entered.set()
            await self.release.wait()
            return JSONResponse({"paymentId": f"p_{self.executions}"}, status_code=201)

        middleware = Middleware(
            IdempotencyMiddleware, store=MemoryStore(clock=self.clock), clock=self.clock
        )
        return Starlette(
            routes=[Route("/payments", pay, methods=["POST"])], middleware=[middleware]
        )

    async def sleep(self, seconds: float) -> None:
        """The duplicate's sleep: time passes, and the first request ends when it is due."""
        self.sleeps.append(seconds)
        self.clock.advance(seconds)
        if self.clock.now >= self.ends_at and not self.release.is_set():
            self.release.set()
            await self.finished.wait()

    async def run(self, **client_options: Any) -> httpx.Response:
        app = self.app()
        first_client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        )
        recorder = _Recorder(httpx.ASGITransport(app=app), self.retry_afters)
        transport = AsyncIdempotentTransport(
            recorder, sleep=self.sleep, rng=lambda: 0.0, clock=self.clock, **client_options
        )
        async with first_client, httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def first_request() -> None:
                response = await first_client.post("/payments", json={"amount": 1}, headers=KEY)
                assert response.status_code == 201
                self.finished.set()

            first = asyncio.create_task(first_request())
            async with asyncio.timeout(5):
                await self.entered.wait()
                duplicate = await c.post("/payments", json={"amount": 1}, headers=KEY)
                self.release.set()
                await first
        return duplicate

    @property
    def lateness(self) -> float:
        """Fake seconds between the first request's end and the duplicate's answer."""
        return self.clock.now - self.ends_at


class _Recorder(httpx.AsyncBaseTransport):
    """Notes the ``Retry-After`` of every answer the duplicate gets."""

    def __init__(self, transport: httpx.AsyncBaseTransport, seen: list[str]) -> None:
        self.transport = transport
        self.seen = seen

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.transport.handle_async_request(request)
        self.seen.append(response.headers.get("retry-after", "-"))
        return response


async def test_default_client_gets_the_replay_soon_after_a_slow_first_request() -> None:
    payment = SlowPayment(duration=7.5)
    response = await payment.run()
    assert response.status_code == 201
    assert response.headers["x-idempotent-replay"] == "true"
    assert response.json() == {"paymentId": "p_1"}
    assert payment.executions == 1
    # The server's hint (1 s so early on) is the floor, the client's doubling backoff the wait;
    # a hint of the whole remaining lock (600 s) would have sent the client away for good.
    assert payment.retry_afters == ["1", "1", "1", "1", "-"]
    assert payment.sleeps == [1.0, 1.0, 2.0, 4.0]
    assert payment.lateness == 0.5


async def test_server_hints_pace_a_client_through_a_long_first_request() -> None:
    payment = SlowPayment(duration=40.0)
    # A client whose own backoff stays below the server's hints: the hints decide every wait.
    response = await payment.run(backoff_base=0.1, backoff_cap=0.5, max_attempts=30)
    assert response.headers["x-idempotent-replay"] == "true"
    assert payment.executions == 1
    # A quarter of the time the first request has run, rounded up, at least 1 s.
    assert payment.sleeps == [1, 1, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 10]
    assert payment.retry_afters == [str(int(s)) for s in payment.sleeps] + ["-"]
    assert payment.lateness == 8.0
    assert payment.lateness <= payment.duration / 4


async def test_a_first_request_longer_than_max_retry_after_ends_the_retries() -> None:
    payment = SlowPayment(duration=1000.0)
    response = await payment.run(backoff_base=0.1, backoff_cap=0.5, max_attempts=100)
    # Once the server asks for more than 60 s, the 409 is the answer, at once.
    assert response.status_code == 409
    assert int(response.headers["retry-after"]) > 60
    assert max(payment.sleeps) <= 60
    assert payment.executions == 1
