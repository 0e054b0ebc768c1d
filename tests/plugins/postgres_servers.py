"""PostgreSQL fixtures: a database of this run's own, and private servers for outage tests.

``postgres_dsn`` points at a database created for this test run (``idem_test_<random>``) and
dropped at its end, on the server named by ``DATABASE_URL`` when that is set, else on a
throwaway server started for the session. So runs never disturb each other or the databases
already on a shared server. Tests keep apart by table name (``postgres_table``).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import pytest

from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing.postgres_server import PostgresServer


def dsn_with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database (URL or libpq ``key=value`` form)."""
    if "://" not in dsn:
        return f"{dsn} dbname={database}"
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def _admin(dsn: str, statement: str) -> None:
    """Run one statement on its own connection, in a thread of its own: session fixtures can be
    first requested from inside a running event loop (``request.getfixturevalue``)."""
    import asyncpg  # type: ignore[import-untyped]

    async def run() -> None:
        connection = await asyncpg.connect(dsn, timeout=30)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    with ThreadPoolExecutor(max_workers=1) as executor:
        executor.submit(asyncio.run, run()).result()


@pytest.fixture(scope="session")
def postgres_admin_dsn() -> Iterator[str]:
    """A DSN with the right to create databases: ``DATABASE_URL`` or a session server."""
    url = os.environ.get("DATABASE_URL")
    if url:
        yield url
        return
    with PostgresServer() as server:
        yield server.dsn


@pytest.fixture(scope="session")
def postgres_dsn(postgres_admin_dsn: str) -> Iterator[str]:
    """A DSN for a database that exists for this test run only."""
    database = f"idem_test_{uuid.uuid4().hex[:12]}"
    _admin(postgres_admin_dsn, f'CREATE DATABASE "{database}"')
    try:
        yield dsn_with_database(postgres_admin_dsn, database)
    finally:
        _admin(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@pytest.fixture
def postgres_table() -> str:
    """A table name of the test's own."""
    return f"idem_{uuid.uuid4().hex[:16]}"


@pytest.fixture
async def postgres_store(postgres_dsn: str, postgres_table: str) -> AsyncIterator[PostgresStore]:
    """A store on its own table (schema created), closed after the test."""
    store = await PostgresStore.connect(postgres_dsn, table=postgres_table)
    try:
        await store.create_schema()
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, to stop and start."""
    with PostgresServer() as server:
        yield server
