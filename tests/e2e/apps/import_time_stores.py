"""FastAPI apps whose store is built at import time, for ``uvicorn
tests.e2e.apps.import_time_stores:app`` with uvicorn's default lifespan mode.

``$IDEM_TEST_SETUP`` picks how the store gets its connections:

- ``from_dsn``: ``PostgresStore.from_dsn`` on ``$IDEM_TEST_DSN``, and no lifespan of the app's
  own: the table exists already (a migration made it), so the middleware's startup check is
  the store's first operation;
- ``use_pool``: ``PostgresStore()``, handed the asyncpg pool the app's lifespan opens (and
  still uses after it yielded, then closes);
- ``redis``: ``RedisStore.from_url`` on ``$IDEM_TEST_REDIS_URL`` (``$IDEM_TEST_DRIVER``).

Every connection is named ``$IDEM_TEST_NAME`` (PostgreSQL's ``application_name``, Redis's client
name). When the lifespan's ``shutdown.complete`` leaves the app (after the idempotency
middleware's part of the shutdown, before the process exits), the outermost layer prints how
many connections of that name the server still has: ``connections at shutdown: N``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import redis.asyncio as aioredis
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, PostgresStore, RedisStore, idempotent
from starlette_idempotency.stores.base import IdempotencyStore

SETUP = os.environ["IDEM_TEST_SETUP"]
NAME = os.environ["IDEM_TEST_NAME"]
DSN = os.environ.get("IDEM_TEST_DSN", "")
REDIS_URL = os.environ.get("IDEM_TEST_REDIS_URL", "")


async def connections_named(name: str) -> int:
    """How many connections named ``name`` the store's server has now."""
    if SETUP == "redis":
        client = aioredis.from_url(REDIS_URL)
        try:
            clients: list[dict[str, Any]] = await client.client_list()
        finally:
            await client.aclose()
        return sum(entry.get("name") == name for entry in clients)
    connection = await asyncpg.connect(DSN)
    try:
        query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
        count: int = await connection.fetchval(query, name)
    finally:
        await connection.close()
    return count


class ConnectionsAtShutdown:
    """Prints the connections left once the app's shutdown has run, middleware included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def report_then_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                count = await connections_named(NAME)
                print(f"connections at shutdown: {count}", file=sys.stderr, flush=True)
            await send(message)

        await self.app(scope, receive, report_then_send)


store: IdempotencyStore
lifespan: Any = None
if SETUP == "from_dsn":
    store = PostgresStore.from_dsn(
        DSN, table=os.environ["IDEM_TEST_TABLE"], server_settings={"application_name": NAME}
    )
elif SETUP == "use_pool":
    store = postgres = PostgresStore(table=os.environ["IDEM_TEST_TABLE"])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        options = {"server_settings": {"application_name": NAME}}
        async with asyncpg.create_pool(DSN, min_size=1, max_size=4, **options) as pool:
            postgres.use_pool(pool)
            yield
            # the middleware left the pool to the app: its shutdown can still use it
            assert await pool.fetchval("SELECT 1") == 1
else:
    store = RedisStore.from_url(
        REDIS_URL,
        key_prefix=os.environ["IDEM_TEST_PREFIX"],
        driver="glide" if os.environ.get("IDEM_TEST_DRIVER") == "glide" else "redis-py",
        client_name=NAME,
    )

app = FastAPI(lifespan=lifespan)
app.add_middleware(IdempotencyMiddleware, store=store, key_scope=lambda request: "tenant")
app.add_middleware(ConnectionsAtShutdown)
runs = 0


@app.post("/payments")
@idempotent()
async def pay() -> dict[str, int]:
    global runs
    runs += 1
    return {"run": runs}
