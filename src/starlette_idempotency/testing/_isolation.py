"""Keeping tests apart on a shared server without touching anything else on it.

Redis: each test writes under a key prefix of its own (:func:`unique_prefix`), and its keys are
deleted afterwards (:func:`delete_prefixed`); nothing is ever flushed. PostgreSQL: a test run
gets a database of its own (:func:`run_database`), dropped at its end, and each test a table of
its own in it (:func:`unique_table`), dropped after the test (:func:`drop_table`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from starlette_idempotency.stores._postgres_sql import quote_table

if TYPE_CHECKING:
    import redis.asyncio as aioredis


def unique_prefix() -> str:
    """A Redis key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex}"


async def delete_prefixed(client: aioredis.Redis | aioredis.RedisCluster, prefix: str) -> None:
    """Delete every key under ``prefix:`` (one key at a time, so it works on a Cluster)."""
    async for key in client.scan_iter(match=f"{prefix}:*", count=500):
        await client.delete(key)


async def delete_prefixed_at(url: str, prefix: str) -> None:
    """:func:`delete_prefixed` on the Redis at ``url``, through a client of its own."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(url)
    try:
        await delete_prefixed(client, prefix)
    finally:
        await client.aclose()


def unique_table() -> str:
    """A PostgreSQL table name no other test uses."""
    return f"idem_{uuid.uuid4().hex[:16]}"


def dsn_with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database (URL or libpq ``key=value`` form)."""
    if "://" not in dsn:
        return f"{dsn} dbname={database}"
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def run_admin(
    dsn: str, statement: str, *args: Any, server_settings: dict[str, str] | None = None
) -> Any:
    """Run one statement on a connection of its own and return its first value.

    It runs in a thread of its own, with its own event loop, so that it works from session
    fixtures too, which may be first requested inside a test's running loop
    (``request.getfixturevalue``); it blocks the caller meanwhile.
    """
    import asyncpg  # type: ignore[import-untyped]

    async def run() -> Any:
        connection = await asyncpg.connect(dsn, timeout=30, server_settings=server_settings)
        try:
            return await connection.fetchval(statement, *args)
        finally:
            await connection.close()

    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, run()).result()


def drop_table(dsn: str, table: str) -> None:
    """Drop ``table`` (a name of :func:`unique_table`) if it exists, with its index and the
    table of operation claims beside it. A test that still holds it in an open transaction
    makes this fail after a few seconds rather than hang the run."""
    names = quote_table(table)
    run_admin(
        dsn,
        f"DROP TABLE IF EXISTS {names.table}, {names.operations}",
        server_settings={"lock_timeout": "5s"},
    )


@contextlib.contextmanager
def run_database(admin_dsn: str) -> Iterator[str]:
    """A DSN of a new database (``idem_test_<random>``) on ``admin_dsn``'s server, dropped
    (with any connections still open to it) when the block ends."""
    database = f"idem_test_{uuid.uuid4().hex[:12]}"
    run_admin(admin_dsn, f'CREATE DATABASE "{database}"')
    try:
        yield dsn_with_database(admin_dsn, database)
    finally:
        run_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


__all__ = [
    "delete_prefixed",
    "delete_prefixed_at",
    "drop_table",
    "dsn_with_database",
    "run_admin",
    "run_database",
    "unique_prefix",
    "unique_table",
]
