"""The benchmarked service: one FastAPI ``POST /payments`` behind each configuration's layer.

A user's payments app: a four-field camelCase pydantic model (``accountId``, ``amount: float``,
``currency``, ``merchantReference``) answered 201 with a small dict. The endpoint counts its
executions and the distinct ``Idempotency-Key`` values it saw, served at ``GET /__executions``
(a GET, outside every layer's guard), so the harness can check that no key ran twice. uvicorn
serves it with ``bench.app:create_app --factory``, configured by the ``BENCH_*`` environment
variables; the in-process benchmarks call :func:`build_app`.

Each layer is wired as its README shows, with the safety it offers switched on where it is an
option (mobius fails closed, as ours does); peers run with their own defaults otherwise.
"""

from __future__ import annotations

import gc
import importlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from bench.configs import BY_NAME
from bench.requests import EXECUTIONS_PATH, PAYMENT_PATH

Hook = Callable[[], Awaitable[None]]
Endpoint = Callable[..., Awaitable[dict[str, Any]]]


class PaymentRequest(BaseModel):
    accountId: str  # the wire names of the user's API, camelCase
    amount: float
    currency: str
    merchantReference: str


@dataclass
class AppSettings:
    """How to build the app; round-trips through ``BENCH_*`` environment variables."""

    config: str
    redis_url: str | None = None
    postgres_dsn: str | None = None
    prefix: str = "bench"
    pg_table: str = "bench_idempotency"

    @classmethod
    def from_env(cls) -> AppSettings:
        env = os.environ
        return cls(
            config=env.get("BENCH_CONFIG", "bare"),
            redis_url=env.get("BENCH_REDIS_URL") or None,
            postgres_dsn=env.get("BENCH_POSTGRES_DSN") or None,
            prefix=env.get("BENCH_PREFIX", "bench"),
            pg_table=env.get("BENCH_PG_TABLE", "bench_idempotency"),
        )

    def to_env(self) -> dict[str, str]:
        return {
            "BENCH_CONFIG": self.config,
            "BENCH_PREFIX": self.prefix,
            "BENCH_PG_TABLE": self.pg_table,
            "BENCH_REDIS_URL": self.redis_url or "",
            "BENCH_POSTGRES_DSN": self.postgres_dsn or "",
        }

    def require(self, value: str | None, what: str) -> str:
        if not value:
            raise RuntimeError(f"configuration {self.config!r} needs {what}")
        return value


@dataclass
class CollectorTime:
    """Seconds spent in the cyclic garbage collector, and its collections by generation, as
    :meth:`watch` (a ``gc.callbacks`` entry) sees them."""

    seconds: float = 0.0
    by_generation: list[int] = field(default_factory=lambda: [0, 0, 0])
    _started: float = 0.0

    @property
    def collections(self) -> int:
        return sum(self.by_generation)

    def watch(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self.by_generation[info["generation"]] += 1
        else:
            self.seconds += time.perf_counter() - self._started


@dataclass
class AppState:
    """What the endpoint counts."""

    executions: int = 0
    keys: set[str] = field(default_factory=set)


@dataclass
class Lifespan:
    """What the app's lifespan starts and closes (a layer's pool, client or backend)."""

    starters: list[Hook] = field(default_factory=list)
    closers: list[Hook] = field(default_factory=list)


def build_app(settings: AppSettings, collector_time: CollectorTime | None = None) -> FastAPI:
    """The app for ``settings.config``; its executions endpoint reports ``collector_time``
    (the server's: see :func:`create_app`)."""
    if settings.config not in BY_NAME:
        raise ValueError(f"unknown configuration {settings.config!r}")
    state = AppState()
    hooks = Lifespan()
    collector = collector_time if collector_time is not None else CollectorTime()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for start in hooks.starters:
            await start()
        if BY_NAME[settings.config].freeze_heap:
            # What an application may do once started: its modules and startup objects leave
            # the collector's walks for good.
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            for close in reversed(hooks.closers):
                await close()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    async def create_payment(payment: PaymentRequest, request: Request) -> dict[str, Any]:
        state.executions += 1
        key = request.headers.get("idempotency-key")
        if key is not None:
            state.keys.add(key)
        return {
            "paymentId": f"pay_{state.executions:020d}",
            "status": "accepted",
            "accountId": payment.accountId,
            "amount": payment.amount,
            "currency": payment.currency,
            "merchantReference": payment.merchantReference,
        }

    async def executions() -> dict[str, Any]:
        return {
            "executions": state.executions,
            "distinct_keys": len(state.keys),
            "collections": collector.by_generation,
            "collector_seconds": collector.seconds,
        }

    endpoint = _wire(app, settings, create_payment, hooks)
    app.post(PAYMENT_PATH, status_code=201)(endpoint)
    app.get(EXECUTIONS_PATH)(executions)
    return app


def _wire(app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan) -> Endpoint:
    """Add the configuration's layer; the endpoint to route (decorated where a layer says so)."""
    name, prefix = BY_NAME[settings.config].wiring, settings.prefix
    if name == "bare":
        return endpoint
    if name.startswith("floor-"):
        from bench.floor import DictFloorClient, FloorClient, FloorMiddleware

        client: FloorClient
        if name == "floor-redis":
            import redis.asyncio as aioredis

            redis_client = aioredis.from_url(settings.require(settings.redis_url, "a Redis URL"))
            hooks.closers.append(redis_client.aclose)
            client = redis_client
        else:
            client = DictFloorClient()
        checked = name == "floor-memory-checked"
        app.add_middleware(FloorMiddleware, client=client, prefix=prefix, check_body=checked)
        return endpoint
    wire = {
        "ours": _wire_ours,
        "aih": _wire_aih,
        "mobius": _wire_mobius,
        "idemkit": _wire_idemkit,
        "idemgate": _wire_idemgate,
    }[name.split("-", 1)[0]]
    return wire(app, settings, endpoint, hooks)


def _wire_ours(
    app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan
) -> Endpoint:
    from starlette_idempotency import IdempotencyMiddleware, IdempotencyStore, idempotent

    config = BY_NAME[settings.config]
    name, prefix = config.wiring, settings.prefix
    store: IdempotencyStore
    if name == "ours-memory":
        from starlette_idempotency import MemoryStore

        store = MemoryStore(key_prefix=prefix)
    elif name == "ours-postgres":
        import asyncpg  # type: ignore[import-untyped]

        from starlette_idempotency import PostgresStore

        # Created here, initialised by the lifespan: the middleware stack is built (on the
        # first ASGI call, the lifespan's) before any startup code could await a connect().
        pool = asyncpg.create_pool(
            settings.require(settings.postgres_dsn, "a PostgreSQL DSN"), min_size=1, max_size=10
        )
        pg_store = PostgresStore(pool, table=settings.pg_table, key_prefix=prefix)

        async def start_pool() -> None:
            await pool
            await pg_store.create_schema()

        hooks.starters.append(start_pool)
        store = pg_store
    else:
        from starlette_idempotency import RedisStore

        store = RedisStore.from_url(
            settings.require(settings.redis_url, "a Redis URL"),
            key_prefix=prefix,
            acquire="lua" if name == "ours-redis-lua" else "setnx",
            driver="glide" if name == "ours-redis-glide" else "redis-py",
        )
    hooks.closers.append(store.aclose)
    app.add_middleware(IdempotencyMiddleware, store=store, protect_all=config.protect_all)
    return endpoint if config.protect_all else idempotent()(endpoint)


def _wire_aih(app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan) -> Endpoint:
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends import MemoryBackend, RedisBackend
    from idempotency_header_middleware.backends.base import Backend

    backend: Backend
    if settings.config == "aih-redis":
        import redis.asyncio as aioredis

        client = aioredis.from_url(settings.require(settings.redis_url, "a Redis URL"))
        backend = RedisBackend(
            redis=client,
            keys_key=f"{settings.prefix}:aih-keys",
            response_key=f"{settings.prefix}:aih-response:",
        )
        hooks.closers.append(client.aclose)
    else:
        backend = MemoryBackend()
    # A dataclass middleware: Starlette's ParamSpec-typed factory cannot check it.
    middleware: Any = IdempotencyHeaderMiddleware
    app.add_middleware(middleware, backend=backend)
    return endpoint


def _wire_mobius(
    app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan
) -> Endpoint:
    from mobius_idempotence import IdempotencyConfig, IdempotencyManager, idempotent
    from mobius_idempotence.backends.base import StorageBackend

    backend: StorageBackend
    if settings.config == "mobius-redis":
        from mobius_idempotence.backends.redis import RedisBackend

        url = settings.require(settings.redis_url, "a Redis URL")
        backend = RedisBackend(url, key_prefix=f"{settings.prefix}:")
    else:
        from mobius_idempotence.backends.memory import MemoryBackend

        backend = MemoryBackend(key_prefix=f"{settings.prefix}:")
    manager = IdempotencyManager(backend, IdempotencyConfig(fail_open=False))
    hooks.closers.append(manager.aclose)
    return idempotent(manager, status_code=201)(endpoint)


def _wire_idemkit(
    app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan
) -> Endpoint:
    # The README's way for a whole FastAPI app: its ASGI middleware, POST and PATCH guarded,
    # leases and fencing tokens built in, failing closed by default.
    from idemkit import IdempotencyMiddleware, InMemoryBackend
    from idemkit.backends.redis import RedisBackend

    backend: RedisBackend | InMemoryBackend
    if settings.config == "idemkit-redis":
        url = settings.require(settings.redis_url, "a Redis URL")
        backend = RedisBackend.from_url(url, namespace=settings.prefix)
    else:
        # Its default max_size (10,000) refuses every new key once a run has made that many;
        # like every other store here, it must accept them all.
        backend = InMemoryBackend(max_size=10_000_000)
    hooks.closers.append(backend.aclose)
    app.add_middleware(IdempotencyMiddleware, backend=backend)
    return endpoint


def _wire_idemgate(
    app: FastAPI, settings: AppSettings, endpoint: Endpoint, hooks: Lifespan
) -> Endpoint:
    # Its README: IdempotencyRoute as the route class before the route is added, the store on
    # app.state, @idempotent on the endpoint. Owner tokens and fenced writes are not options.
    # Imported by name: idemgate is installed without its dependencies (it pins redis<8), so
    # the dev environment's type check does not see it.
    idemgate: Any = importlib.import_module("idemgate")
    redis_store: Any = importlib.import_module("idemgate.redis_store")
    import redis.asyncio as aioredis

    client = aioredis.from_url(settings.require(settings.redis_url, "a Redis URL"))
    app.state.idempotency_store = redis_store.RedisAcquirer(client, key_prefix=settings.prefix)
    app.router.route_class = idemgate.IdempotencyRoute
    hooks.closers.append(client.aclose)
    guarded: Endpoint = idemgate.idempotent()(endpoint)
    return guarded


def create_app() -> FastAPI:
    """The uvicorn factory: ``uvicorn bench.app:create_app --factory`` (``BENCH_*`` env).

    The worker's collections and the time they take are counted for its whole life, so load
    runs read what the collector costs where the requests run."""
    spent = CollectorTime()
    gc.callbacks.append(spent.watch)
    return build_app(AppSettings.from_env(), spent)
