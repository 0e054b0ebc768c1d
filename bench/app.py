"""The benchmarked service: one FastAPI ``POST /payments`` behind each configuration's layer.

Two shapes of the service (``BENCH_APP``):

- ``plain``: a snake_case body with an ``int`` amount, answered with a ~300-byte document.
- ``payments``: the user's app of issue #17, a four-field camelCase model (``accountId``,
  ``amount: float``, ``currency``, ``merchantReference``) answered with a small dict.

Either validates its pydantic body and answers 201. The endpoint counts its executions and the
distinct ``Idempotency-Key`` values it saw, served at ``GET /__executions`` (a GET, outside
every layer's guard), so the harness can check that no key ran twice. ``GET /__gc`` serves the
garbage collector's pauses (:mod:`bench.gcwatch`, installed by the uvicorn factory) and, for
the MemoryStore configurations, ``GET /__prefill?n=`` fills the store with ``n`` live records
(:mod:`bench.prefill`). uvicorn serves it with ``bench.app:create_app --factory``, configured by
the ``BENCH_*`` environment variables; the in-process benchmarks call :func:`build_app`.
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

from bench.configs import APPS, BY_NAME, AppName
from bench.gcwatch import GcWatch
from bench.prefill import prefill_memory_store
from bench.requests import EXECUTIONS_PATH, GC_PATH, PAYMENT_PATH, PREFILL_PATH, REQUEST_BODIES

Hook = Callable[[], Awaitable[None]]
PoolInit = Callable[[Any], Awaitable[None]]

_DESCRIPTION = "Benchmark payment, fixed-size body"


class PaymentIn(BaseModel):
    account_id: str = Field(min_length=1, max_length=64)
    amount: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    reference: str = Field(min_length=1, max_length=128)


class PaymentRequest(BaseModel):
    """The ``payments`` app's body: four plain fields, as a user's model would have them."""

    accountId: str  # the wire names of the user's API, camelCase
    amount: float
    currency: str
    merchantReference: str


@dataclass
class AppSettings:
    """How to build the app; round-trips through ``BENCH_*`` environment variables."""

    config: str
    app: AppName = "plain"
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
        app = env.get("BENCH_APP", "plain")
        return cls(
            config=env.get("BENCH_CONFIG", "bare"),
            app=next((name for name in APPS if name == app), "plain"),
            redis_url=env.get("BENCH_REDIS_URL") or None,
            postgres_dsn=env.get("BENCH_POSTGRES_DSN") or None,
            prefix=env.get("BENCH_PREFIX", "bench"),
            pg_table=env.get("BENCH_PG_TABLE", "bench_idempotency"),
            lock_ttl_seconds=float(lock_ttl) if lock_ttl else None,
        )

    def to_env(self) -> dict[str, str]:
        env = {
            "BENCH_CONFIG": self.config,
            "BENCH_APP": self.app,
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
    gc_watch: GcWatch | None = None  # the collector's pauses (the uvicorn factory installs it)

    async def executed(self, request: Request) -> int:
        """Count one execution of the endpoint (and honour the in-process knobs)."""
        self.executions += 1
        key = request.headers.get("idempotency-key")
        if key is not None:
            self.keys.add(key)
        if self.entered is not None:
            self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.executions


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
    """The app for ``settings.config`` in the ``settings.app`` shape, and its state."""
    if settings.config not in BY_NAME:
        raise ValueError(f"unknown configuration {settings.config!r}")
    if settings.app not in APPS:
        raise ValueError(f"unknown app {settings.app!r}")
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
        return payment_response(payment, await state.executed(request))

    async def create_user_payment(payment: PaymentRequest, request: Request) -> dict[str, Any]:
        number = await state.executed(request)
        return {
            "paymentId": f"pay_{number:020d}",
            "status": "accepted",
            "accountId": payment.accountId,
            "amount": payment.amount,
            "currency": payment.currency,
            "merchantReference": payment.merchantReference,
        }

    async def executions() -> dict[str, int]:
        return {"executions": state.executions, "distinct_keys": len(state.keys)}

    async def gc_pauses() -> dict[str, Any]:
        watch = state.gc_watch or GcWatch()
        return watch.snapshot().to_json()

    handler = create_user_payment if settings.app == "payments" else create_payment
    endpoint = _wire(app, settings, state, handler, starters, closers)
    app.post(PAYMENT_PATH, status_code=201)(endpoint)
    app.get(EXECUTIONS_PATH)(executions)
    app.get(GC_PATH)(gc_pauses)
    if BY_NAME[settings.config].wiring == "ours-memory":

        async def prefill(n: int) -> dict[str, Any]:
            return await prefill_memory_store(app, state.store, n, REQUEST_BODIES[settings.app])

        app.get(PREFILL_PATH)(prefill)
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
    name, prefix = BY_NAME[settings.config].wiring, settings.prefix
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

    config = BY_NAME[settings.config]
    name, prefix = config.wiring, settings.prefix
    store: IdempotencyStore
    if name == "ours-memory":
        from starlette_idempotency import MemoryStore

        store = MemoryStore(key_prefix=prefix)
    elif name.startswith("ours-redis-"):  # setnx and lua on redis-py; glide (setnx)
        from starlette_idempotency import RedisStore

        store = RedisStore.from_url(
            _require(settings.redis_url, "a Redis URL", name),
            key_prefix=prefix,
            acquire="lua" if name == "ours-redis-lua" else "setnx",
            driver="glide" if name == "ours-redis-glide" else "redis-py",
        )
    elif name == "ours-postgres":
        import asyncpg  # type: ignore[import-untyped]

        from starlette_idempotency import PostgresStore

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
    if config.protect_all:  # every POST guarded, the route left as the user wrote it
        options["protect_all"] = True
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    closers.append(store.aclose)
    state.store = store
    return endpoint if config.protect_all else idempotent()(endpoint)


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
    """The uvicorn factory: ``uvicorn bench.app:create_app --factory`` (``BENCH_*`` env).

    Installs the garbage collector's stopwatch (:mod:`bench.gcwatch`), served at ``/__gc``:
    one callback per collection, the same in every configuration."""
    app, state = build_app(AppSettings.from_env())
    state.gc_watch = GcWatch().install()
    return app
