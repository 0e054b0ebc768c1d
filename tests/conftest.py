"""The suite gets its Redis and PostgreSQL from the public pytest plugin, as users do; the
project's own fixtures come on top of it: private servers for outage tests, a Redis Cluster,
and a connection name to find (and end) a test's PostgreSQL connections by.

The shared servers (``redis_url``, ``redis_key_prefix``, ``redis_store``; ``postgres_dsn``,
``postgres_table``, ``postgres_store``...) are the plugin's,
:mod:`starlette_idempotency.testing.pytest_plugin`. Tests share them, so they never FLUSH or
stop them; tests that stop, freeze or pause a server use ``private_redis`` or
``private_postgres``. Helpers shared by the tests are in :mod:`tests.support`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from starlette_idempotency.testing._postgres_server import PostgresServer
from starlette_idempotency.testing._redis_server import RedisClusterServers, RedisServer

pytest_plugins = [
    "pytester",
    "starlette_idempotency.testing.pytest_plugin",
]


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own, free to stop, restart, freeze or pause."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A three-primary Redis Cluster started once per run."""
    with RedisClusterServers() as cluster:
        yield cluster


@pytest.fixture
def application_name() -> str:
    """A name of the test's own for the connections it opens, to find (and end) them."""
    return f"idem-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test's own, to stop and start."""
    with PostgresServer() as server:
        yield server
