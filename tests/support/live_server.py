"""The client tests' server: the idempotency middleware over a small Starlette app, with a
fault injector outside the middleware, run by a real uvicorn in a background thread.

The endpoints and the injector count what happened in a :class:`ServerLedger`, keyed by the
request's ``Idempotency-Key``, so tests sharing the server never see each other's numbers.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._responses import ErrorFormat
from tests.support.uvicorn import uvicorn_thread

KEY_HEADER = "Idempotency-Key"
#: How long the server-side waits (a held handler, a withheld reply) may last at most.
HOLD_LIMIT_SECONDS = 10.0


@dataclass
class ServerLedger:
    """What the server did, per idempotency key; written by the server thread."""

    requests: Counter[str] = field(default_factory=Counter)
    handler_calls: Counter[str] = field(default_factory=Counter)
    executions: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    entered: dict[str, threading.Event] = field(default_factory=dict)
    release: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, counter: Counter[str], key: str) -> int:
        with self.lock:
            counter[key] += 1
            return counter[key]

    def events(self, key: str) -> tuple[threading.Event, threading.Event]:
        """(handler entered, handler may finish) for ``key``."""
        with self.lock:
            entered = self.entered.setdefault(key, threading.Event())
            release = self.release.setdefault(key, threading.Event())
        return entered, release


class FaultInjector:
    """Outside the idempotency middleware: on a key's first request, lets the app run to the
    end (so the response is stored) and then loses the reply.

    ``x-fault: drop`` sends the status line and headers, then fails, so uvicorn closes the
    connection in the middle of the response. ``x-fault: withhold`` sends nothing and waits
    for the client to give up.
    """

    def __init__(self, app: ASGIApp, ledger: ServerLedger) -> None:
        self.app = app
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        key = request.headers.get(KEY_HEADER, "")
        self.ledger.count(self.ledger.requests, key)
        fault = request.headers.get("x-fault")
        if fault is None or self.ledger.count(self.ledger.faults, key) > 1:
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        if fault == "drop":
            await send(held[0])
            raise ConnectionAbortedError("fault injected: reply lost after the headers")
        with anyio.move_on_after(HOLD_LIMIT_SECONDS):
            while (await receive())["type"] != "http.disconnect":
                pass


def build_app(ledger: ServerLedger, error_format: ErrorFormat = "json") -> ASGIApp:
    def key_of(request: Request) -> str:
        return request.headers.get(KEY_HEADER, "")

    @idempotent()
    async def flaky(request: Request) -> Response:
        """Answers 503 ``x-fail-times`` times (before any side effect), then pays."""
        key = key_of(request)
        call = ledger.count(ledger.handler_calls, key)
        if call <= int(request.headers.get("x-fail-times", "0")):
            return JSONResponse({"error": "warming up"}, status_code=503)
        return await pay(request)

    @idempotent(lock_ttl_seconds=1)
    async def held(request: Request) -> Response:
        """Pays once the test releases the key's event."""
        key = key_of(request)
        ledger.count(ledger.handler_calls, key)
        entered, release = ledger.events(key)
        entered.set()
        await anyio.to_thread.run_sync(release.wait, HOLD_LIMIT_SECONDS)
        return await pay(request)

    async def pay(request: Request) -> Response:
        key = key_of(request)
        if request.headers.get("content-type", "").startswith("application/x-www-form"):
            body = dict(await request.form())  # what stripe-python sends
        else:
            body = await request.json()
        execution = ledger.count(ledger.executions, key)
        return JSONResponse(
            {"paymentId": f"p_{key}_{execution}", "amount": body.get("amount")}, status_code=201
        )

    @idempotent()
    async def payments(request: Request) -> Response:
        ledger.count(ledger.handler_calls, key_of(request))
        return await pay(request)

    app = Starlette(
        routes=[
            Route("/flaky", flaky, methods=["POST"]),
            Route("/held", held, methods=["POST"]),
            Route("/payments", payments, methods=["POST", "PATCH"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), error_format=error_format)
        ],
    )
    return FaultInjector(app, ledger)


@dataclass
class LiveServer:
    base_url: str
    ledger: ServerLedger


def serve(error_format: ErrorFormat = "json") -> Iterator[LiveServer]:
    """The test app behind uvicorn on a free loopback port, in a thread of this process."""
    ledger = ServerLedger()
    with uvicorn_thread(build_app(ledger, error_format)) as base_url:
        yield LiveServer(base_url, ledger)


async def plain_post(base_url: str, path: str, key: str, **kwargs: Any) -> httpx.Response:
    """One POST with no retries, as a client without this helper would send it (httpx's sync
    client, in a worker thread)."""

    def send() -> httpx.Response:
        headers = {KEY_HEADER: key, **kwargs.pop("headers", {})}
        with httpx.Client(base_url=base_url, timeout=10.0) as client:
            return client.post(path, headers=headers, **kwargs)

    return await anyio.to_thread.run_sync(send)
