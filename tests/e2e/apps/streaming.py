"""A Starlette app whose guarded endpoint streams its answer slowly, for clients that hang up."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent

CHUNKS = 200
CHUNK = b"x" * 1024

executions: Counter[str] = Counter()


@idempotent()
async def stream(request: Request) -> Response:
    executions["stream"] += 1
    status = int(request.query_params.get("status", "200"))

    async def body() -> AsyncIterator[bytes]:
        for _ in range(CHUNKS):
            yield CHUNK
            await asyncio.sleep(0.005)  # a slow producer, so the client can leave mid-stream

    return StreamingResponse(body(), status_code=status, media_type="text/plain")


async def count(request: Request) -> Response:
    return JSONResponse(dict(executions))


app = Starlette(
    routes=[Route("/stream", stream, methods=["POST"]), Route("/count", count)],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")],
)
