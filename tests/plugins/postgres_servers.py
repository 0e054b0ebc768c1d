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
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._process import wait_until
from starlette_idempotency.testing.postgres_server import PostgresServer


def dsn_with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database (URL or libpq ``key=value`` form)."""
    if "://" not in dsn:
        return f"{dsn} dbname={database}"
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def _admin(dsn: str, statement: str, *args: Any) -> Any:
    """Run one statement on its own connection, in a thread of its own, and return its first
    value: session fixtures can be first requested from inside a running event loop
    (``request.getfixturevalue``), and see :func:`terminate_backends`."""
    import asyncpg  # type: ignore[import-untyped]

    async def run() -> Any:
        connection = await asyncpg.connect(dsn, timeout=30)
        try:
            return await connection.fetchval(statement, *args)
        finally:
            await connection.close()

    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, run()).result()


def terminate_backends(dsn: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection named ``application_name``, waiting until
    each backend has exited; returns how many there were.

    It blocks the calling thread, so when called from a test's event loop, that loop's pools
    have not yet read the termination notices when it returns: their next statement meets the
    dead connection, as does a request that arrives just as the server ends its connections
    (a restart, failover or ``idle_session_timeout``).
    """
    terminated: int = _admin(
        dsn,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
        "FROM pg_stat_activity WHERE application_name = $1",
        application_name,
    )
    return terminated


def wait_for_no_backends(dsn: str, application_name: str, timeout: float = 10.0) -> None:
    """Block until no connection named ``application_name`` is left (the server ended them,
    e.g. on ``idle_session_timeout``); like :func:`terminate_backends`, it blocks the caller's
    event loop, so the client side has not read the termination yet when it returns."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    wait_until(
        lambda: _admin(dsn, query, application_name) == 0,
        timeout=timeout,
        what=f"the connections named {application_name!r} to end",
    )


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
def application_name() -> str:
    """A name of the test's own for the connections it opens, to find (and end) them."""
    return f"idem-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, to stop and start."""
    with PostgresServer() as server:
        yield server
