"""A Starlette app on RedisStore (``$IDEM_TEST_REDIS_URL``) with a handler that waits until
``/release`` is called, and the events the middleware reported."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyEvent, IdempotencyMiddleware, RedisStore, idempotent


def create_app() -> Starlette:
    executions: Counter[str] = Counter()
    events: list[IdempotencyEvent] = []
    released = asyncio.Event()

    @idempotent(lock_ttl_seconds=float(os.environ.get("IDEM_TEST_LOCK_TTL", "30")))
    async def slow(request: Request) -> Response:
        executions["slow"] += 1
        if request.query_params.get("wait"):
            await released.wait()
        return JSONResponse({"run": executions["slow"]})

    async def release(request: Request) -> Response:
        released.set()
        return JSONResponse({})

    async def state(request: Request) -> Response:
        lost = [event.note for event in events if event.result == "LOCK_LOST"]
        return JSONResponse({"executions": executions["slow"], "lock_lost": lost})

    store = RedisStore.from_url(os.environ["IDEM_TEST_REDIS_URL"], key_prefix="e2e")
    middleware = Middleware(
        IdempotencyMiddleware,
        store=store,
        key_scope=lambda request: "t",
        store_timeout_seconds=0.5,
        on_event=events.append,
    )
    routes = [
        Route("/slow", slow, methods=["POST"]),
        Route("/release", release, methods=["POST"]),
        Route("/state", state),
    ]
    return Starlette(routes=routes, middleware=[middleware])
