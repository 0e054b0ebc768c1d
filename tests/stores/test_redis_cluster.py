"""RedisStore on a three-node Redis Cluster (the contract suite runs there too, see conftest).

Each record is one key, so nothing needs hash tags: keys of different routes spread over slots
and nodes, and every script and pipeline touches a single slot.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from starlette_idempotency.stores.redis import AcquireStrategy, RedisStore
from starlette_idempotency.stores.redis._driver import lua_source
from starlette_idempotency.testing._isolation import delete_prefixed, unique_prefix
from starlette_idempotency.testing._redis_server import RedisClusterServers
from tests.support.conditions import eventually
from tests.support.records import finished, pending
from tests.support.stores import STRATEGIES, replica_waiting_store, timed_acquire

pytestmark = [pytest.mark.redis, pytest.mark.cluster]

LOCK_TTL = 30.0
ACQUIRE_SHA = hashlib.sha1(lua_source("acquire").encode()).hexdigest()


@pytest.fixture
async def cluster_client(
    redis_cluster: RedisClusterServers,
) -> AsyncIterator[aioredis.RedisCluster]:
    client = aioredis.RedisCluster.from_url(redis_cluster.url)
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(cluster_client: aioredis.RedisCluster) -> AsyncIterator[str]:
    name = unique_prefix()
    yield name
    await delete_prefixed(cluster_client, name)


async def test_keys_of_different_routes_spread_over_slots_and_nodes(
    cluster_client: aioredis.RedisCluster, prefix: str
) -> None:
    store = RedisStore(cluster_client, key_prefix=prefix)
    # The middleware escapes braces in key parts, so no storage key carries a hash tag.
    keys = [f"POST:/route-{n}/%7Bid%7D:tenant%3A1:key-1" for n in range(48)]

    for key in keys:
        assert (await store.try_acquire(key, pending(key, "owner-a"), LOCK_TTL)).acquired

    slots = [await cluster_client.cluster_keyslot(store.storage_key(key)) for key in keys]
    found = [cluster_client.get_node_from_key(store.storage_key(key)) for key in keys]
    nodes = {node.name for node in found if node is not None}
    assert slots == [key_slot(store.storage_key(key).encode()) for key in keys]
    assert len(set(slots)) > len(keys) // 2  # whole keys hash: collisions are rare
    assert len(nodes) == 3  # all three nodes hold some (chance of a miss: 3 * (2/3)**48)
    for key in keys:
        stored = await store.get(key)
        assert stored is not None
        assert stored.key == key


@STRATEGIES
async def test_wait_replicas_on_a_cluster_node_without_replicas(
    cluster_client: aioredis.RedisCluster,
    prefix: str,
    acquire: AcquireStrategy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = replica_waiting_store(cluster_client, prefix, acquire, wait_timeout_ms=100)

    result, elapsed = await timed_acquire(store, pending("k", "owner-a"), caplog)

    assert result.acquired
    assert 0.05 < elapsed < 2.0
    assert "0 of 1 Redis replicas acknowledged" in caplog.text
    conflict = await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)
    assert conflict.record is not None
    assert conflict.record.owner_token == "owner-a"


@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["no-wait", "wait"])
async def test_scripts_reload_on_every_node_after_script_flush(
    cluster_client: aioredis.RedisCluster, prefix: str, wait_replicas: int
) -> None:
    store = RedisStore(
        cluster_client,
        key_prefix=prefix,
        acquire="lua",
        wait_replicas=wait_replicas,
        wait_timeout_ms=10,
    )
    keys = [f"POST:/route-{n}:key" for n in range(6)]
    await store.try_acquire("warm", pending("warm", "owner-a"), LOCK_TTL)
    await cluster_client.script_flush()  # on every primary
    assert await cluster_client.script_exists(ACQUIRE_SHA) == [False]

    for key in keys:
        record = pending(key, "owner-a")
        assert (await store.try_acquire(key, record, LOCK_TTL)).acquired
        assert await store.renew(key, "owner-a", LOCK_TTL)
        assert await store.finish(key, finished(record), 60)
        assert await store.release(key, "owner-a")


async def test_aclose_leaves_a_cluster_client_open(
    cluster_client: aioredis.RedisCluster, prefix: str
) -> None:
    store = RedisStore(cluster_client, key_prefix=prefix)
    await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)

    await store.aclose()

    assert await cluster_client.get(store.storage_key("k")) is not None


async def test_a_cancelled_call_leaves_no_half_read_connection(
    cluster_client: aioredis.RedisCluster, prefix: str
) -> None:
    """As on a single server: the node holds the acquire (CLIENT PAUSE WRITE), the caller's
    timeout cancels it, and neither the held SET nor its owed reply survives."""
    store = RedisStore(cluster_client, key_prefix=prefix)
    warm = pending("warm", "owner-a")
    await store.try_acquire("warm", warm, LOCK_TTL)
    await cluster_client.initialize()
    skey = store.storage_key("k")
    node = cluster_client.get_node_from_key(skey)
    assert node is not None
    admin = aioredis.Redis(host=node.host, port=int(node.port))

    async def blocked_clients() -> int:
        info: dict[str, Any] = await admin.info("clients")
        return int(info["blocked_clients"])

    async def bounded_call() -> None:
        async with asyncio.timeout(0.5):  # as the middleware bounds store calls
            await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)

    try:
        await admin.client_pause(10_000, all=False)
        try:
            call = asyncio.create_task(bounded_call())
            await eventually(
                lambda: _is(blocked_clients(), 1), message="the acquire held by the pause"
            )
            with pytest.raises(TimeoutError):
                await call
            await eventually(lambda: _is(blocked_clients(), 0), message="the cancelled client gone")
        finally:
            await admin.client_unpause()

        assert await admin.get(skey) is None
        stored = await store.get("warm")
        assert stored is not None
        assert stored.owner_token == "owner-a"
        assert (await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)).acquired
    finally:
        await admin.aclose()


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected
