"""PostgreSQL fixtures of this project's own: private servers, and ending connections by name.

The shared server (``postgres_admin_dsn``, ``postgres_dsn``, ``postgres_table``,
``postgres_store``) comes from the public plugin,
:mod:`starlette_idempotency.testing.pytest_plugin`, as it does for users: a database of this
run's own on ``DATABASE_URL``'s server or a throwaway one, and a table per test.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from starlette_idempotency.testing._process import wait_until
from starlette_idempotency.testing.isolation import run_admin
from starlette_idempotency.testing.postgres_server import PostgresServer


def terminate_backends(dsn: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection named ``application_name``, waiting until
    each backend has exited; returns how many there were.

    It blocks the calling thread, so when called from a test's event loop, that loop's pools
    have not yet read the termination notices when it returns: their next statement meets the
    dead connection, as does a request that arrives just as the server ends its connections
    (a restart, failover or ``idle_session_timeout``).
    """
    terminated: int = run_admin(
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
        lambda: run_admin(dsn, query, application_name) == 0,
        timeout=timeout,
        what=f"the connections named {application_name!r} to end",
    )


@pytest.fixture
def application_name() -> str:
    """A name of the test's own for the connections it opens, to find (and end) them."""
    return f"idem-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, to stop and start."""
    with PostgresServer() as server:
        yield server


__all__ = [
    "application_name",
    "private_postgres",
    "terminate_backends",
    "wait_for_no_backends",
]
