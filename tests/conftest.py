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

#: Fixtures that reach a server process (Redis, PostgreSQL, the demo's pods and nginx).
SERVER_FIXTURES = frozenset(
    {
        "redis_url",
        "postgres_admin_dsn",
        "private_redis",
        "private_postgres",
        "redis_cluster",
        "clusters",
    }
)
#: Modules whose names, imported by a test module, start servers: Redis, PostgreSQL,
#: uvicorn, nginx, Prometheus, or the command line against a database.
SERVER_MODULES = frozenset(
    {
        "examples.payments.cluster",
        "starlette_idempotency.testing._postgres_server",
        "starlette_idempotency.testing._redis_server",
        "tests.support.cli",
        "tests.support.live_server",
        "tests.support.prometheus",
        "tests.support.uvicorn",
    }
)


#: Markers of tests that need a server (the store parameters carry them).
SERVER_MARKERS = ("redis", "postgres", "cluster", "e2e")
#: The plugin's fixtures on a server, as tests name them to ``request.getfixturevalue``.
SERVER_BACKED = SERVER_FIXTURES | {
    "redis_store",
    "redis_key_prefix",
    "postgres_store",
    "postgres_dsn",
}


def _starts_servers(item: pytest.Item) -> bool:
    if any(item.get_closest_marker(name) for name in SERVER_MARKERS):
        return True
    if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and SERVER_BACKED.intersection(
        value for value in callspec.params.values() if isinstance(value, str)
    ):
        return True
    module = getattr(item, "module", None)
    if module is None:
        return False
    return any(
        getattr(value, "__module__", None) in SERVER_MODULES for value in vars(module).values()
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``services`` every test that needs a server process, so that ``task test:unit``
    (``-m "not services and not slow"``) runs the rest in seconds."""
    for item in items:
        if _starts_servers(item):
            item.add_marker(pytest.mark.services)


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
