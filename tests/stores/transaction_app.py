"""A payments app whose effects are fenced: the payment row and the idempotency record commit in
one transaction (``idempotency_transaction``), and the provider is called with a derived key.

Run in-process by ``test_postgres_transaction`` and as uvicorn pods by
``test_transaction_pods`` (``uvicorn --factory tests.stores.transaction_app:create_app``,
configured by environment variables: ``IDEM_TEST_DSN``, ``IDEM_TEST_TABLE``,
``IDEM_TEST_DRIVER`` (``asyncpg``, ``sqlalchemy`` or ``session``), ``IDEM_TEST_POD``).

``POST /pay`` (``lock_ttl_seconds=LOCK_TTL_SECONDS``) with ``{"amount": "9.99"}``: calls the
fake provider with ``derived_key("provider.charge")`` (a row per derived key in
``{table}_provider``, as a provider keeps one charge per idempotency key, and a count of the
calls it got), then inserts the payment into ``{table}_payments`` and responds, both in one
transaction at the isolation of ``X-Isolation`` (the app opens it; the library joins it).
Headers that make a first attempt misbehave (sent on the first attempt only; headers are not
part of the fingerprint): ``X-Block-Seconds`` blocks the event loop that long before the
transaction (computing, no await), ``X-Sleep-Seconds`` awaits that long (the lock is not
renewed on ``/pay-unrenewed``), ``X-Die-After-Commit`` kills the process with SIGKILL once the
transaction has committed, before the response goes out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from starlette_idempotency import (
    IdempotencyMiddleware,
    PostgresStore,
    idempotency_context,
    idempotency_transaction,
    idempotent,
)

LOCK_TTL_SECONDS = 2.0
ISOLATIONS = ("read_committed", "repeatable_read", "serializable")


def sqlalchemy_url(dsn: str) -> str:
    return "postgresql+asyncpg://" + dsn.split("://", 1)[1]


async def create_tables(sql: Any, table: str) -> None:
    await sql.execute(
        f"CREATE TABLE IF NOT EXISTS {table}_payments ("
        " id serial PRIMARY KEY, idempotency_key text NOT NULL, amount text NOT NULL,"
        " pod text NOT NULL)"
    )
    await sql.execute(
        f"CREATE TABLE IF NOT EXISTS {table}_provider ("
        " derived_key text PRIMARY KEY, charge_id serial, calls integer NOT NULL)"
    )


async def drop_tables(sql: Any, table: str) -> None:
    for suffix in ("payments", "provider"):
        await sql.execute(f"DROP TABLE IF EXISTS {table}_{suffix}")


def first_value(result: Any) -> Any:
    return result.scalar() if result.returns_rows else None


class Database:
    """The app's own connections (an asyncpg pool, or a SQLAlchemy engine), opened on first use
    in the running loop, and the statements of its handler on one of them."""

    def __init__(self, dsn: str, table: str, driver: str) -> None:
        self.dsn, self.table, self.driver = dsn, table, driver
        self._pool: Any = None
        self._engine: AsyncEngine | None = None

    async def charge(self, derived_key: str) -> int:
        """The fake provider: one charge per derived key, every call counted."""
        pool = await self._asyncpg()
        charge_id: int = await pool.fetchval(
            f"INSERT INTO {self.table}_provider (derived_key, calls) VALUES ($1, 1) "
            "ON CONFLICT (derived_key) DO UPDATE SET calls = EXCLUDED.calls + "
            f"{self.table}_provider.calls RETURNING charge_id",
            derived_key,
        )
        return charge_id

    async def in_transaction(
        self, isolation: str, work: Callable[[Any, Callable[..., Awaitable[Any]]], Awaitable[Any]]
    ) -> Any:
        """Run ``work(connection, fetchval)`` in a transaction of the app's own at
        ``isolation``, the way each driver's users open one."""
        if self.driver == "asyncpg":
            pool = await self._asyncpg()
            async with pool.acquire() as connection, connection.transaction(isolation=isolation):
                return await work(connection, connection.fetchval)
        level = isolation.upper().replace("_", " ")
        engine = self._sqlalchemy().execution_options(isolation_level=level)
        if self.driver == "sqlalchemy":
            async with engine.connect() as connection, connection.begin():

                async def fetchval(sql: str, *args: Any) -> Any:
                    return first_value(await connection.exec_driver_sql(sql, args))

                return await work(connection, fetchval)
        async with AsyncSession(engine) as session, session.begin():

            async def session_fetchval(sql: str, *args: Any) -> Any:
                raw = await session.connection()
                return first_value(await raw.exec_driver_sql(sql, args))

            return await work(session, session_fetchval)

    async def _asyncpg(self) -> Any:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=8)
        return self._pool

    def _sqlalchemy(self) -> AsyncEngine:
        if self._engine is None:
            self._engine = create_async_engine(sqlalchemy_url(self.dsn), pool_size=8)
        return self._engine

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self._engine is not None:
            await self._engine.dispose()


def build_app(
    dsn: str, table: str, driver: str, pod: str = "", **options: Any
) -> tuple[Starlette, Database, PostgresStore]:
    """The app, its database and its store (``options`` go to the middleware)."""
    store = PostgresStore.from_dsn(dsn, table=table)
    database = Database(dsn, table, driver)

    async def pay(request: Request) -> Response:
        body = await request.json()
        headers = request.headers
        key = headers["idempotency-key"]
        if "x-block-seconds" in headers:  # computing without an await: the loop is blocked
            deadline = time.monotonic() + float(headers["x-block-seconds"])
            while time.monotonic() < deadline:
                sum(range(1000))
        if "x-sleep-seconds" in headers:
            await asyncio.sleep(float(headers["x-sleep-seconds"]))
        charge_id = await database.charge(
            idempotency_context(request).derived_key("provider.charge")
        )

        async def record(connection: Any, fetchval: Callable[..., Awaitable[Any]]) -> Response:
            async with idempotency_transaction(request, connection) as tx:
                payment_id = await fetchval(
                    f"INSERT INTO {table}_payments (idempotency_key, amount, pod) "
                    "VALUES ($1, $2, $3) RETURNING id",
                    key,
                    body["amount"],
                    pod,
                )
                await tx.checkpoint("payment_written", {"payment_id": payment_id})
                answer = {"payment_id": payment_id, "charge_id": charge_id, "pod": pod}
                return await tx.respond(JSONResponse(answer, status_code=201))

        response: Response = await database.in_transaction(
            headers.get("x-isolation", "read_committed"), record
        )
        if "x-die-after-commit" in headers:
            os.kill(os.getpid(), signal.SIGKILL)
        return response

    async def healthz(request: Request) -> Response:
        return JSONResponse({})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await database.aclose()

    app = Starlette(
        routes=[
            Route("/pay", idempotent(lock_ttl_seconds=LOCK_TTL_SECONDS)(pay), methods=["POST"]),
            Route(
                "/pay-unrenewed",
                idempotent(lock_ttl_seconds=LOCK_TTL_SECONDS, renew_lock=False)(pay),
                methods=["POST"],
            ),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app, database, store


def create_app() -> ASGIApp:
    """``uvicorn --factory tests.stores.transaction_app:create_app``."""
    env = os.environ
    app, _, _ = build_app(
        env["IDEM_TEST_DSN"], env["IDEM_TEST_TABLE"], env["IDEM_TEST_DRIVER"], env["IDEM_TEST_POD"]
    )
    return app
