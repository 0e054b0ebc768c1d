"""RedisStore on valkey-glide: configuration, round trips, lazy connection, errors, lost replies.

The contract suite runs on glide too (``redis-glide-*`` in ``STORE_FACTORIES``), and so do the
race and middleware tests; this module covers what is the driver's own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as aioredis
from glide import GlideClient, GlideError

from starlette_idempotency._record import Checkpoint, dump_record, record_to_dict
from starlette_idempotency.errors import ConfigurationError, StoreError
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.stores.redis._glide import config_from_url
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.conditions import eventually
from tests.support.records import LOCK_TTL, RETENTION_TTL, finished, pending
from tests.support.stores import (
    DRIVERS,
    STRATEGIES,
    command_calls,
    commands_sent,
    equals,
    glide_client,
)

pytestmark = pytest.mark.redis


@pytest.fixture
async def private_glide(private_redis: RedisServer) -> AsyncIterator[GlideClient]:
    client: GlideClient = await glide_client(private_redis.url)
    yield client
    await client.close()


# -- configuration -----------------------------------------------------------------------------


def test_config_from_url_reads_every_part() -> None:
    config = config_from_url("rediss://app:p%40ss@cache.internal:6390/3", client_name="api")

    assert [(a.host, a.port) for a in config.addresses] == [("cache.internal", 6390)]
    assert config.use_tls
    assert config.credentials is not None
    assert (config.credentials.username, config.credentials.password) == ("app", "p@ss")
    assert config.database_id == 3
    assert config.client_name == "api"
    assert config.request_timeout == 5000  # not glide's 250 ms: the middleware bounds calls


def test_config_from_url_defaults() -> None:
    config = config_from_url("redis://localhost", request_timeout=800)

    assert [(a.host, a.port) for a in config.addresses] == [("localhost", 6379)]
    assert not config.use_tls
    assert config.credentials is None
    assert config.database_id is None
    assert config.request_timeout == 800


@pytest.mark.parametrize(
    "url",
    ["unix:///run/redis.sock", "redis://localhost/0?socket_timeout=1", "redis://localhost/db"],
)
def test_unsupported_urls_raise_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError):
        RedisStore.from_url(url, driver="glide")


async def test_wait_replicas_needs_redis_py(redis_url: str) -> None:
    with pytest.raises(ConfigurationError, match="wait_replicas needs a redis-py client"):
        RedisStore.from_url(redis_url, driver="glide", wait_replicas=1)
    client = await glide_client(redis_url)
    try:
        with pytest.raises(ConfigurationError, match="wait_replicas"):
            RedisStore(client, wait_replicas=1)
    finally:
        await client.close()


def test_unknown_clients_and_drivers_raise_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"RedisStore needs a redis\.asyncio client"):
        RedisStore(object())
    with pytest.raises(ConfigurationError, match="driver must be"):
        RedisStore.from_url("redis://localhost", driver="hiredis")  # type: ignore[arg-type]


# -- round trips -------------------------------------------------------------------------------


@STRATEGIES
async def test_a_request_takes_the_same_commands_as_on_redis_py(
    admin: aioredis.Redis, private_glide: GlideClient, acquire: AcquireStrategy
) -> None:
    store = RedisStore(private_glide, key_prefix="p", acquire=acquire)
    warm = pending("warm", "a")
    await store.try_acquire("warm", warm, 30)  # loads the scripts once
    await store.finish("warm", finished(warm), 60)
    record = pending("k", "a")

    first = await commands_sent(admin, lambda: store.try_acquire("k", record, 30))
    done = await commands_sent(admin, lambda: store.finish("k", finished(record), 60))
    replay = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "b"), 30))

    if acquire == "setnx":
        assert first == replay == {"set": 1}
    else:  # the script's own GET and SET count as commands, but cost no round trip
        assert first == {"evalsha": 1, "get": 1, "set": 1}
        assert replay == {"evalsha": 1, "get": 1}
    assert done == {"evalsha": 1, "get": 1, "set": 1, "publish": 1}


# -- the client: created on first use, owned or not ---------------------------------------------


async def named_connections(admin: aioredis.Redis, name: str) -> int:
    clients: list[dict[str, Any]] = await admin.client_list()
    return sum(1 for client in clients if client.get("name") == name)


async def test_from_url_connects_once_on_first_use_and_aclose_closes_it(
    private_redis: RedisServer, admin: aioredis.Redis
) -> None:
    name = f"store-{uuid.uuid4().hex[:8]}"
    store = RedisStore.from_url(private_redis.url, driver="glide", client_name=name)
    assert await named_connections(admin, name) == 0  # nothing before the first call

    await asyncio.gather(*(store.get(f"k{n}") for n in range(30)))  # concurrent first calls

    assert await named_connections(admin, name) == 1
    await store.aclose()
    await eventually(
        lambda: equals(named_connections(admin, name), 0), message="the store's connection to close"
    )


async def test_aclose_leaves_a_client_passed_in_open(private_glide: GlideClient) -> None:
    store = RedisStore(private_glide)
    await store.get("k")

    await store.aclose()

    assert await private_glide.ping() == b"PONG"


async def test_a_failed_first_connection_is_tried_again(private_redis: RedisServer) -> None:
    store = RedisStore.from_url(private_redis.url, driver="glide")
    try:
        private_redis.stop()
        with pytest.raises(StoreError) as caught:
            await store.get("k")
        assert isinstance(caught.value.__cause__, GlideError)

        private_redis.start()
        assert (await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)).acquired
    finally:
        await store.aclose()


# -- lost replies ------------------------------------------------------------------------------


@DRIVERS
async def test_an_acquire_resent_after_a_lost_reply_is_still_ours(
    redis_url: str, redis_key_prefix: str, driver: DriverName
) -> None:
    """A client that resends an acquire whose reply it lost (a reconnect) finds its own
    record: that is an acquire, not a conflict with itself."""
    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix, driver=driver)
    client = aioredis.from_url(redis_url)
    try:
        record = pending("k", "owner-a")
        await client.set(f"{redis_key_prefix}:k", dump_record(record), px=30_000)

        result = await store.try_acquire("k", record, LOCK_TTL)

        assert result.acquired
        assert result.record is None
        # A takeover resent after a lost reply: ours, and its checkpoints come back.
        now = time.time()
        taken = replace(
            pending("t", "owner-b"), checkpoints=(Checkpoint("sent", [1], now),), locked_until=now
        )
        await client.set(f"{redis_key_prefix}:t", dump_record(taken), px=30_000)
        result = await store.try_acquire("t", pending("t", "owner-b"), LOCK_TTL)
        assert result.acquired
        assert result.record is not None
        assert record_to_dict(result.record) == record_to_dict(taken)
    finally:
        await store.aclose()
        await client.aclose()


async def test_an_acquire_abandoned_on_a_paused_server_is_undone(
    private_redis: RedisServer, admin: aioredis.Redis
) -> None:
    """glide keeps its connection when a call is cancelled, so Redis runs the held acquire at
    UNPAUSE; the store's fenced release, queued behind it, deletes it again."""
    store = RedisStore.from_url(private_redis.url, driver="glide", key_prefix="p")
    try:
        await store.get("warm")
        await admin.client_pause(10_000, all=False)  # hold writes only
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):  # as the middleware bounds store calls
                await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)
        assert await _calls(admin, "eval") == 0  # the release waits behind the held acquire
        await admin.client_unpause()

        await eventually(lambda: equals(_calls(admin, "eval"), 1), message="the release to run")
        assert await _calls(admin, "set") == 1, "the held acquire ran first"
        assert await admin.get("p:k") is None
        assert (await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)).acquired
    finally:
        await store.aclose()


# -- change notices ----------------------------------------------------------------------------


@DRIVERS
async def test_concurrent_waiters_share_one_subscriber_connection(
    redis_url: str, redis_key_prefix: str, driver: DriverName
) -> None:
    name = f"waiters-{uuid.uuid4().hex[:8]}"
    waiting = RedisStore.from_url(
        redis_url, key_prefix=redis_key_prefix, driver=driver, client_name=name
    )
    other = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    admin = aioredis.from_url(redis_url)
    keys = [f"k{n}" for n in range(10)]
    try:
        records = {key: pending(key, "owner") for key in keys}
        for key, record in records.items():
            assert (await other.try_acquire(key, record, LOCK_TTL)).acquired
        await waiting.get("warm")  # connected: the waits below start together
        waiters = [asyncio.create_task(waiting.wait_for_change(key)) for key in keys]

        async def subscriber_connections() -> list[int]:
            clients: list[dict[str, Any]] = await admin.client_list()
            return [int(c["sub"]) for c in clients if c.get("name") == name and int(c["sub"])]

        await eventually(
            lambda: equals(subscriber_connections(), [len(keys)]),
            message="one connection subscribed to every key",
        )
        for key, record in records.items():
            assert await other.finish(key, finished(record), RETENTION_TTL)
        async with asyncio.timeout(5):
            await asyncio.gather(*waiters)
    finally:
        await waiting.aclose()
        await other.aclose()
        await admin.aclose()


# -- helpers -----------------------------------------------------------------------------------


async def _calls(admin: aioredis.Redis, command: str) -> int:
    return (await command_calls(admin)).get(command, 0)
