"""Two hosts serving ``POST /orders``: guarded on ``api.example``, open on ``admin.example``."""

from __future__ import annotations

from collections import Counter

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Route, Router

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent

runs: Counter[str] = Counter()


@idempotent()
async def api_orders(request: Request) -> Response:
    runs["api"] += 1
    return JSONResponse({"host": "api", "run": runs["api"]}, status_code=201)


async def admin_orders(request: Request) -> Response:
    runs["admin"] += 1
    return JSONResponse({"host": "admin", "run": runs["admin"]}, status_code=201)


async def count(request: Request) -> Response:
    return JSONResponse(dict(runs))


app = Starlette(
    routes=[
        Host("api.example", Router([Route("/orders", api_orders, methods=["POST"])])),
        Host("admin.example", Router([Route("/orders", admin_orders, methods=["POST"])])),
        Route("/runs", count),
    ],
    middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")],
)
