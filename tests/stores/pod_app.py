"""A pod for the store tests that need processes of their own (``test_skewed_pods``,
``test_blocked_pods``): uvicorn runs it over RedisStore or PostgresStore, configured by
environment variables.

Its wall clock can be off: ``time.time`` is replaced in the whole process by the real time plus
an offset (``IDEM_TEST_CLOCK_OFFSET`` seconds, changed at run time by ``POST /_clock`` with
``{"offset": seconds}``, as an NTP step or a resumed VM changes it mid-request). Everything
that reads the wall clock sees it: the middleware, the stores, the logs.

``POST /pay`` and ``POST /pay-hold`` (``on_recovery="hold"``) record a recovery point, then
wait until ``POST /_release/{key}`` (a first attempt only: a retry that took the key over
answers at once, so that a second run shows in the test instead of hanging it).
``POST /compute`` (``lock_ttl_seconds=2``) blocks the event loop, computing for
``IDEM_TEST_BLOCK_SECONDS`` without an await, as a CPU-bound ``async def`` handler does.
``GET /_runs/{key}`` says how many times this pod started a handler for the key (and saved its
recovery point), ``GET /_lease/{route}/{key}`` the lease the store shows for the record,
``GET /_observed`` the processing timeouts counted and the lock renewal's warnings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg  # type: ignore[import-untyped]
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from starlette_idempotency import (
    IdempotencyMiddleware,
    PostgresStore,
    RedisStore,
    checkpoint,
    idempotency_context,
    idempotent,
    storage_key,
)
from starlette_idempotency.observability import IdempotencyEvent
from starlette_idempotency.stores.base import IdempotencyStore

LOCK_TTL_SECONDS = 3.0
COMPUTE_LOCK_TTL_SECONDS = 2.0
_real_time = time.time
_offset = float(os.environ.get("IDEM_TEST_CLOCK_OFFSET", "0"))


def _skewed_time() -> float:
    return _real_time() + _offset


time.time = _skewed_time


class Observed(logging.Handler):
    """The processing timeouts counted (a metrics sink) and lock renewal's warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.timeouts: Counter[str] = Counter()
        self.warnings: list[str] = []

    def observe_event(self, event: IdempotencyEvent) -> None:
        pass

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        pass

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        self.timeouts[f"{endpoint} {reason}"] += 1

    def emit(self, record: logging.LogRecord) -> None:
        self.warnings.append(record.getMessage())


def create_app() -> ASGIApp:
    """``uvicorn --factory tests.stores.pod_app:create_app``."""
    runs: Counter[str] = Counter()
    observed = Observed()
    logging.getLogger("starlette_idempotency._renewal").addHandler(observed)
    checkpointed: Counter[str] = Counter()
    gates: dict[str, asyncio.Event] = {}
    store: IdempotencyStore
    pool = None
    if os.environ["IDEM_TEST_STORE"] == "redis":
        store = RedisStore.from_url(
            os.environ["IDEM_TEST_REDIS_URL"], key_prefix=os.environ["IDEM_TEST_PREFIX"]
        )
    else:
        pool = asyncpg.create_pool(os.environ["IDEM_TEST_DSN"], min_size=1, max_size=4)
        store = PostgresStore(pool, table=os.environ["IDEM_TEST_TABLE"])

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        runs[key] += 1
        context = idempotency_context(request)
        if context.recovered_from is not None:
            return JSONResponse({"recovered_from": context.recovered_from}, status_code=201)
        await checkpoint(request, "provider_called", {"ref": key})
        checkpointed[key] += 1
        gate = gates.setdefault(key, asyncio.Event())
        async with asyncio.timeout(60):
            await gate.wait()
        return JSONResponse({"recovered_from": None}, status_code=201)

    async def compute(request: Request) -> Response:
        runs[request.headers["idempotency-key"]] += 1
        deadline = time.monotonic() + float(os.environ.get("IDEM_TEST_BLOCK_SECONDS", "4"))
        while time.monotonic() < deadline:  # computing, the event loop blocked: no await
            sum(range(1000))
        return JSONResponse({"pod": os.environ.get("IDEM_TEST_POD", "")}, status_code=201)

    async def observed_of(request: Request) -> Response:
        return JSONResponse({"timeouts": observed.timeouts, "warnings": observed.warnings})

    async def set_clock(request: Request) -> Response:
        global _offset
        _offset = float((await request.json())["offset"])
        return JSONResponse({"offset": _offset})

    async def release(request: Request) -> Response:
        gates.setdefault(request.path_params["key"], asyncio.Event()).set()
        return JSONResponse({})

    async def runs_of(request: Request) -> Response:
        key = request.path_params["key"]
        return JSONResponse({"runs": runs[key], "checkpointed": checkpointed[key]})

    async def lease_of(request: Request) -> Response:
        """The lease of the record of ``POST /{route}`` with ``key``, as the store shows it."""
        route, key = request.path_params["route"], request.path_params["key"]
        record = await store.get(storage_key("", "POST", f"/{route}", key))
        return JSONResponse({"locked_until": None if record is None else record.locked_until})

    async def healthz(request: Request) -> Response:
        return JSONResponse({})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if pool is not None:
            await pool  # opens its connections
            assert isinstance(store, PostgresStore)
            await store.create_schema()
        try:
            yield
        finally:
            await store.aclose()
            if pool is not None:
                await pool.close()

    guarded = idempotent(lock_ttl_seconds=LOCK_TTL_SECONDS)(pay)
    held = idempotent(lock_ttl_seconds=LOCK_TTL_SECONDS, on_recovery="hold")(pay)
    app = Starlette(
        routes=[
            Route("/pay", guarded, methods=["POST"]),
            Route("/pay-hold", held, methods=["POST"]),
            Route(
                "/compute",
                idempotent(lock_ttl_seconds=COMPUTE_LOCK_TTL_SECONDS)(compute),
                methods=["POST"],
            ),
            Route("/_observed", observed_of),
            Route("/_clock", set_clock, methods=["POST"]),
            Route("/_release/{key}", release, methods=["POST"]),
            Route("/_runs/{key}", runs_of),
            Route("/_lease/{route}/{key}", lease_of),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )
    return IdempotencyMiddleware(app, store=store, metrics=observed)
