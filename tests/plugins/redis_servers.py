"""Redis fixtures of this project's own: private servers for outage tests, a 3-node Cluster.

The shared server (``redis_url``, ``redis_key_prefix``, ``redis_store``) comes from the public
plugin, :mod:`starlette_idempotency.testing.pytest_plugin`, as it does for users. Tests share
it, so they never FLUSH or stop it; tests that stop, freeze or pause a server use
``private_redis``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from starlette_idempotency.testing.isolation import delete_prefixed, unique_prefix
from starlette_idempotency.testing.redis_server import RedisClusterServers, RedisServer


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


__all__ = ["delete_prefixed", "private_redis", "redis_cluster", "unique_prefix"]
