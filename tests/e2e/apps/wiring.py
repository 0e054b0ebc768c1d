"""An app wired in every way ``test_wiring`` checks through real uvicorn, on the store
``$IDEM_TEST_STORE`` names (``memory``, ``redis`` or ``postgres``).

``create_app``: an HTTPEndpoint class, a ``functools.partial``, two hosts and a host pattern
serving one path, a GraphQL-style app mounted whole (guarded by ``protect_all``), and a
path-rewriting middleware inside the guard. ``create_unguarded_app``: the same routes with no
middleware at all. ``create_stacked_app``: FastAPI endpoints under a ``functools.wraps``
decorator stacked above ``@idempotent`` (async, and sync in the threadpool).
``create_post_and_put_app``: a decorated route serving POST and PUT, which the middleware
guards only the POST of. ``create_mounting_app``: a sub-app with a misconfigured
middleware, mounted by a guarded app (``create_unguarded_mounting_app``: by one with no
middleware, and the sub-app's route serves an unguarded PUT).
``create_service``: ``POST /v1/events`` of the service ``$IDEM_TEST_SERVICE``
(``ledger`` or ``notifications``), two apps that share one store and name their operations
apart. ``create_payments``: ``POST /payments`` of version ``$IDEM_TEST_VERSION`` of one app,
whose handler version 2 renamed and moved.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Host, Mount, Route, Router
from starlette.types import Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, IdempotencyStore, MemoryStore, idempotent
from tests.support.decorators import counting_wraps
from tests.support.routing import Rewriting

runs: Counter[str] = Counter()


class Orders(HTTPEndpoint):
    @idempotent()
    async def post(self, request: Request) -> Response:
        runs["class"] += 1
        return JSONResponse({"run": runs["class"]}, status_code=201)


@idempotent()
async def charge(request: Request, *, currency: str) -> Response:
    runs["partial"] += 1
    return JSONResponse({"run": runs["partial"], "currency": currency}, status_code=201)


@idempotent()
async def host_op(request: Request) -> Response:
    name = str(request.path_params.get("tenant", request.url.hostname))
    runs[name] += 1
    return JSONResponse({"host": name, "user": request.headers.get("x-user")}, status_code=201)


async def graphql(scope: Scope, receive: Receive, send: Send) -> None:
    """A sub-app with no router to look into, as GraphQL servers are mounted."""
    request = Request(scope, receive)
    await request.body()
    runs["graphql"] += 1
    await JSONResponse({"run": runs["graphql"]}, status_code=201)(scope, receive, send)


async def counts(request: Request) -> Response:
    return JSONResponse(dict(runs))


def _routes() -> list[BaseRoute]:
    return [
        Route("/orders", Orders),
        Route("/charges", functools.partial(charge, currency="EUR"), methods=["POST"]),
        Host("api.example", Router([Route("/op", host_op, methods=["POST"])])),
        Host("admin.example", Router([Route("/op", host_op, methods=["POST"])])),
        Host("{tenant}.shop.example", Router([Route("/op", host_op, methods=["POST"])])),
        Mount("/graphql", app=graphql),
        Route("/runs", counts),
    ]


def _store() -> tuple[IdempotencyStore, Callable[[Starlette], AbstractAsyncContextManager[None]]]:
    """The store the environment names, and what its lifespan opens and closes."""
    kind = os.environ.get("IDEM_TEST_STORE", "memory")
    if kind == "redis":
        from starlette_idempotency import RedisStore

        store = RedisStore.from_url(
            os.environ["IDEM_TEST_REDIS_URL"], key_prefix=os.environ["IDEM_TEST_PREFIX"]
        )

        @asynccontextmanager
        async def redis_lifespan(app: Starlette) -> AsyncIterator[None]:
            yield
            await store.aclose()

        return store, redis_lifespan
    if kind == "postgres":
        import asyncpg  # type: ignore[import-untyped]

        from starlette_idempotency import PostgresStore

        pool = asyncpg.create_pool(os.environ["IDEM_TEST_DSN"], min_size=1, max_size=4)
        postgres = PostgresStore(pool, table=os.environ["IDEM_TEST_TABLE"])

        @asynccontextmanager
        async def postgres_lifespan(app: Starlette) -> AsyncIterator[None]:
            await pool  # opens its connections in the server's loop
            try:
                await postgres.create_schema()
                yield
            finally:
                await pool.close()

        return postgres, postgres_lifespan
    memory = MemoryStore()

    @asynccontextmanager
    async def memory_lifespan(app: Starlette) -> AsyncIterator[None]:
        yield

    return memory, memory_lifespan


def create_app() -> Starlette:
    store, lifespan = _store()
    middleware = [
        Middleware(
            IdempotencyMiddleware,
            store=store,
            protect_all=True,
            key_scope=lambda request: request.headers.get("x-user"),
        ),
        Middleware(Rewriting),
    ]
    return Starlette(routes=_routes(), middleware=middleware, lifespan=lifespan)


def create_unguarded_app() -> Starlette:
    return Starlette(routes=_routes())


async def ledger(request: Request) -> Response:
    runs["ledger"] += 1
    return JSONResponse({"service": "ledger", "run": runs["ledger"]}, status_code=201)


async def notifications(request: Request) -> Response:
    runs["notifications"] += 1
    return JSONResponse({"service": "notifications", "run": runs["notifications"]}, status_code=201)


def create_service() -> Starlette:
    """One of two services (``$IDEM_TEST_SERVICE``) sharing the store, each its own app, each
    naming its operation; with ``$IDEM_TEST_DEFAULTS``, neither does."""
    service = os.environ["IDEM_TEST_SERVICE"]
    handler = {"ledger": ledger, "notifications": notifications}[service]
    operation = None if os.environ.get("IDEM_TEST_DEFAULTS") else f"{service}.events"
    store, lifespan = _store()
    return Starlette(
        routes=[
            Route("/v1/events", idempotent(operation=operation)(handler), methods=["POST"]),
            Route("/runs", counts),
        ],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
        lifespan=lifespan,
    )


rate_limited = counting_wraps(runs)


class Payment(BaseModel):
    amount: int


def create_stacked_app() -> FastAPI:
    store, lifespan = _store()
    app = FastAPI(lifespan=lifespan)

    @app.post("/payments", status_code=201)
    @rate_limited
    @idempotent()
    async def pay(payment: Payment) -> dict[str, int]:
        runs["pay"] += 1
        return {"run": runs["pay"]}

    @app.post("/refunds", status_code=201)
    @rate_limited
    @idempotent()
    def refund(payment: Payment) -> dict[str, int]:
        runs["refund"] += 1
        return {"run": runs["refund"]}

    app.add_api_route("/runs", counts)
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


@idempotent()
async def upsert(request: Request) -> Response:
    runs[f"upsert {request.method}"] += 1
    return JSONResponse({"run": runs[f"upsert {request.method}"]}, status_code=201)


def create_post_and_put_app() -> Starlette:
    return Starlette(
        routes=[Route("/items", upsert, methods=["POST", "PUT"]), Route("/runs", counts)],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )


def create_mounting_app() -> Starlette:
    sub = Starlette(
        routes=[Route("/items", upsert, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), ttl_hours=-1)],
    )
    return Starlette(
        routes=[Mount("/sub", sub), Route("/runs", counts)],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )


def create_unguarded_mounting_app() -> Starlette:
    sub = Starlette(
        routes=[Route("/items", upsert, methods=["POST", "PUT"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    return Starlette(routes=[Mount("/sub", sub), Route("/runs", counts)])


async def pay(request: Request) -> Response:
    runs["pay"] += 1
    return JSONResponse({"version": 1, "run": runs["pay"]}, status_code=201)


async def create_payment(request: Request) -> Response:
    runs["pay"] += 1
    return JSONResponse({"version": 2, "run": runs["pay"]}, status_code=201)


create_payment.__module__ = "billing.payments"  # moved, as well as renamed


def create_payments() -> Starlette:
    """Version ``$IDEM_TEST_VERSION`` (1 or 2) of one app: version 2 renamed its handler."""
    handler = pay if os.environ["IDEM_TEST_VERSION"] == "1" else create_payment
    store, lifespan = _store()
    return Starlette(
        routes=[
            Route("/payments", idempotent()(handler), methods=["POST"]),
            Route("/runs", counts),
        ],
        middleware=[Middleware(IdempotencyMiddleware, store=store)],
        lifespan=lifespan,
    )
