"""The benchmarked service: one FastAPI ``POST /payments`` behind each configuration's layer.

The endpoint validates a small pydantic body and answers 201 with a ~300-byte JSON document. It
counts its executions and the distinct ``Idempotency-Key`` values it saw, served at
``GET /__executions`` (a GET, outside every layer's guard), so the harness can check that no
key ran twice. uvicorn serves it with ``bench.app:create_app --factory``, configured by the
``BENCH_*`` environment variables; the in-process benchmarks call :func:`build_app` directly.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from bench.configs import BY_NAME

Hook = Callable[[], Awaitable[None]]
PoolInit = Callable[[Any], Awaitable[None]]

PAYMENT_PATH = "/payments"
EXECUTIONS_PATH = "/__executions"
REQUEST_BODY = (
    b'{"account_id":"acct_1MqDcVKZ4aF9xQ2b","amount":1250,"currency":"EUR",'
    b'"reference":"order-2026-000042"}'
)
_DESCRIPTION = "Benchmark payment, fixed-size body"


class PaymentIn(BaseModel):
    account_id: str = Field(min_length=1, max_length=64)
    amount: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    reference: str = Field(min_length=1, max_length=128)


@dataclass
class AppSettings:
    """How to build the app; round-trips through ``BENCH_*`` environment variables."""

    config: str
    redis_url: str | None = None
    postgres_dsn: str | None = None
    prefix: str = "bench"
    pg_table: str = "bench_idempotency"
    lock_ttl_seconds: float | None = None
    pg_init: PoolInit | None = None  # in-process only: e.g. to add a query logger

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> AppSettings:
        env = dict(os.environ) if env is None else env
        lock_ttl = env.get("BENCH_LOCK_TTL_SECONDS")
        return cls(
            config=env.get("BENCH_CONFIG", "bare"),
            redis_url=env.get("BENCH_REDIS_URL") or None,
            postgres_dsn=env.get("BENCH_POSTGRES_DSN") or None,
            prefix=env.get("BENCH_PREFIX", "bench"),
            pg_table=env.get("BENCH_PG_TABLE", "bench_idempotency"),
            lock_ttl_seconds=float(lock_ttl) if lock_ttl else None,
        )

    def to_env(self) -> dict[str, str]:
        env = {
            "BENCH_CONFIG": self.config,
            "BENCH_PREFIX": self.prefix,
            "BENCH_PG_TABLE": self.pg_table,
            "BENCH_REDIS_URL": self.redis_url or "",
            "BENCH_POSTGRES_DSN": self.postgres_dsn or "",
        }
        if self.lock_ttl_seconds is not None:
            env["BENCH_LOCK_TTL_SECONDS"] = str(self.lock_ttl_seconds)
        return env


@dataclass
class AppState:
    """What the endpoint counts, and in-process knobs (never set under uvicorn)."""

    executions: int = 0
    keys: set[str] = field(default_factory=set)
    entered: asyncio.Event | None = None  # set when the handler starts
    gate: asyncio.Event | None = None  # the handler waits for it
    delay: float = 0.0  # the handler sleeps this long
    store: Any = None  # the store or backend, for inspection


def payment_response(payment: PaymentIn, number: int) -> dict[str, Any]:
    """The ~300-byte answer (its size does not depend on the request number)."""
    return {
        "id": f"pay_{number:020d}",
        "object": "payment",
        "status": "succeeded",
        "account_id": payment.account_id,
        "amount": payment.amount,
        "currency": payment.currency,
        "reference": payment.reference,
        "created": 1_800_000_000,
        "description": _DESCRIPTION,
        "metadata": {"source": "bench", "channel": "api"},
        "livemode": False,
    }


def _require(value: str | None, what: str, config: str) -> str:
    if not value:
        raise RuntimeError(f"configuration {config!r} needs {what}")
    return value


def build_app(settings: AppSettings) -> tuple[FastAPI, AppState]:
    """The app for ``settings.config``, and the state its endpoint updates."""
    if settings.config not in BY_NAME:
        raise ValueError(f"unknown configuration {settings.config!r}")
    state = AppState()
    starters: list[Hook] = []
    closers: list[Hook] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for start in starters:
            await start()
        try:
            yield
        finally:
            for close in reversed(closers):
                await close()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    async def create_payment(payment: PaymentIn, request: Request) -> dict[str, Any]:
        state.executions += 1
        key = request.headers.get("idempotency-key")
        if key is not None:
            state.keys.add(key)
        if state.entered is not None:
            state.entered.set()
        if state.gate is not None:
            await state.gate.wait()
        if state.delay:
            await asyncio.sleep(state.delay)
        return payment_response(payment, state.executions)

    async def executions() -> dict[str, int]:
        return {"executions": state.executions, "distinct_keys": len(state.keys)}

    endpoint = _wire(app, settings, state, create_payment, starters, closers)
    app.post(PAYMENT_PATH, status_code=201)(endpoint)
    app.get(EXECUTIONS_PATH)(executions)
    return app, state


def _wire(
    app: FastAPI,
    settings: AppSettings,
    state: AppState,
    endpoint: Callable[..., Awaitable[dict[str, Any]]],
    starters: list[Hook],
    closers: list[Hook],
) -> Callable[..., Any]:
    """Add the configuration's middleware (or decorate the endpoint, as its README shows)."""
    name, prefix = settings.config, settings.prefix
    if name == "bare":
        return endpoint
    if name == "floor-redis":
        import redis.asyncio as aioredis

        from bench.floor import FloorMiddleware

        client = aioredis.from_url(_require(settings.redis_url, "a Redis URL", name))
        app.add_middleware(FloorMiddleware, client=client, prefix=prefix)
        closers.append(client.aclose)
        state.store = client
        return endpoint
    if name == "floor-memory":
        from bench.floor import DictFloorClient, FloorMiddleware

        state.store = DictFloorClient()
        app.add_middleware(FloorMiddleware, client=state.store, prefix=prefix)
        return endpoint
    if name.startswith("ours-"):
        return _wire_ours(app, settings, state, endpoint, starters, closers)
    if name.startswith("aih-"):
        _wire_aih(app, settings, state, closers)
        return endpoint
    if name.startswith("mobius-"):
        from mobius_idempotence import IdempotencyConfig, IdempotencyManager, idempotent
        from mobius_idempotence.backends.base import StorageBackend

        backend: StorageBackend
        if name == "mobius-redis":
            from mobius_idempotence.backends.redis import RedisBackend as MobiusRedis

            url = _require(settings.redis_url, "a Redis URL", name)
            backend = MobiusRedis(url, key_prefix=f"{prefix}:")
        else:
            from mobius_idempotence.backends.memory import MemoryBackend as MobiusMemory

            backend = MobiusMemory(key_prefix=f"{prefix}:")
        manager = IdempotencyManager(backend, IdempotencyConfig(fail_open=False))
        closers.append(manager.aclose)
        state.store = backend
        return idempotent(manager, status_code=201)(endpoint)
    raise ValueError(f"no wiring for configuration {name!r}")


def _wire_ours(
    app: FastAPI,
    settings: AppSettings,
    state: AppState,
    endpoint: Callable[..., Awaitable[dict[str, Any]]],
    starters: list[Hook],
    closers: list[Hook],
) -> Callable[..., Any]:
    from starlette_idempotency import IdempotencyMiddleware, IdempotencyStore, idempotent

    name, prefix = settings.config, settings.prefix
    store: IdempotencyStore
    if name == "ours-memory":
        from starlette_idempotency import MemoryStore

        store = MemoryStore(key_prefix=prefix)
    elif name.startswith("ours-redis-"):  # setnx and lua on redis-py; glide (setnx)
        from starlette_idempotency.stores.redis import RedisStore

        store = RedisStore.from_url(
            _require(settings.redis_url, "a Redis URL", name),
            key_prefix=prefix,
            acquire="lua" if name == "ours-redis-lua" else "setnx",
            driver="glide" if name == "ours-redis-glide" else "redis-py",
        )
    elif name == "ours-postgres":
        import asyncpg  # type: ignore[import-untyped]

        from starlette_idempotency.stores.postgres import PostgresStore

        dsn = _require(settings.postgres_dsn, "a PostgreSQL DSN", name)
        # Created here, initialised by the lifespan: the middleware stack is built (on the
        # first ASGI call, the lifespan's) before any startup code could await a connect().
        # min_size as PostgresStore.connect() sets it; max_size is asyncpg's default.
        pool = asyncpg.create_pool(dsn, min_size=1, max_size=10, init=settings.pg_init)
        pg_store = PostgresStore(pool, table=settings.pg_table, key_prefix=prefix)

        async def start_pool() -> None:
            await pool
            await pg_store.create_schema()

        starters.append(start_pool)
        closers.append(pool.close)
        store = pg_store
    else:
        raise ValueError(f"no wiring for configuration {name!r}")
    options: dict[str, Any] = {}
    if settings.lock_ttl_seconds is not None:
        options["lock_ttl_seconds"] = settings.lock_ttl_seconds
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    closers.append(store.aclose)
    state.store = store
    return idempotent()(endpoint)


def _wire_aih(app: FastAPI, settings: AppSettings, state: AppState, closers: list[Hook]) -> None:
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends.base import Backend

    backend: Backend
    if settings.config == "aih-redis":
        import redis.asyncio as aioredis
        from idempotency_header_middleware.backends import RedisBackend

        client = aioredis.from_url(_require(settings.redis_url, "a Redis URL", settings.config))
        backend = RedisBackend(
            redis=client,
            keys_key=f"{settings.prefix}:aih-keys",
            response_key=f"{settings.prefix}:aih-response:",
        )
        closers.append(client.aclose)
    else:
        from idempotency_header_middleware.backends import MemoryBackend

        backend = MemoryBackend()
    # A dataclass middleware: Starlette's ParamSpec-typed factory cannot check it.
    middleware: Any = IdempotencyHeaderMiddleware
    app.add_middleware(middleware, backend=backend)
    state.store = backend


def create_app() -> FastAPI:
    """The uvicorn factory: ``uvicorn bench.app:create_app --factory`` (``BENCH_*`` env)."""
    app, _ = build_app(AppSettings.from_env())
    return app
