"""Redis fixtures: the shared server by URL, private servers for outage tests, a 3-node Cluster.

``redis_url`` is ``$REDIS_URL`` when set, else a throwaway server started once per run. Tests
share it, so they never FLUSH or stop it: each one writes under its own ``redis_key_prefix``
and the fixture deletes those keys afterwards. Tests that stop, freeze or pause a server use
``private_redis``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from starlette_idempotency.testing.redis_server import RedisClusterServers, RedisServer


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the Redis the tests share (``$REDIS_URL`` or a session server)."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


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


def unique_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex}"


async def delete_prefixed(client: aioredis.Redis | aioredis.RedisCluster, prefix: str) -> None:
    """Delete every key under ``prefix:`` (one key at a time, so it works on a Cluster)."""
    async for key in client.scan_iter(match=f"{prefix}:*", count=500):
        await client.delete(key)


@pytest.fixture
async def redis_key_prefix(redis_url: str) -> AsyncIterator[str]:
    """A fresh key prefix on the shared Redis; its keys are deleted after the test."""
    prefix = unique_prefix()
    yield prefix
    client = aioredis.from_url(redis_url)
    try:
        await delete_prefixed(client, prefix)
    finally:
        await client.aclose()
