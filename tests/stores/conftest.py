"""The `store` fixture: every backend behind one contract, each with its way to let time pass.

A backend factory takes the pytest request (to start only the servers it needs) and is an async
context manager yielding a :class:`Harness`. Add a backend by appending one ``pytest.param`` to
``STORE_FACTORIES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from starlette_idempotency.errors import StoreError
from starlette_idempotency.record import IdempotencyRecord, RecordStatus, StoredResponse
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.memory import MemoryStore
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.testing import FakeClock
from starlette_idempotency.testing.redis_server import RedisClusterServers, RedisServer
from tests.plugins.redis_servers import delete_prefixed, unique_prefix

#: Every Redis acquire strategy, and every Redis driver, for tests that run on each.
STRATEGIES = pytest.mark.parametrize("acquire", ["setnx", "lua"])
DRIVERS = pytest.mark.parametrize("driver", ["redis-py", "glide"])

#: How long a real-time backend may take to drop a key after its TTL, before the test fails.
EXPIRY_GRACE_SECONDS = 5.0


@dataclass
class Harness:
    """A store under test plus how to make ``ttl`` seconds pass for one of its keys.

    ``expire(key, ttl)`` returns once ``store.get(key)`` is ``None``: a fake-clock backend
    advances its clock by ``ttl``; a real-time backend polls until the server dropped the key.
    ``now()`` is the time the store measures record times with.
    """

    store: IdempotencyStore
    expire: Callable[[str, float], Awaitable[None]]
    now: Callable[[], float]


Factory = Callable[[pytest.FixtureRequest], contextlib.AbstractAsyncContextManager[Harness]]


def real_time_harness(store: IdempotencyStore) -> Harness:
    """A harness for a store whose TTLs run on the server's clock."""

    async def expire(key: str, ttl: float) -> None:
        deadline = time.monotonic() + ttl + EXPIRY_GRACE_SECONDS
        while await store.get(key) is not None:
            if time.monotonic() > deadline:
                pytest.fail(f"{key!r} still present {EXPIRY_GRACE_SECONDS}s after its {ttl}s TTL")
            await asyncio.sleep(0.02)  # a poll interval, not a wait for the TTL

    return Harness(store=store, expire=expire, now=time.time)


@contextlib.asynccontextmanager
async def memory_backend(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    clock = FakeClock()
    store = MemoryStore(clock=clock)

    async def expire(key: str, ttl: float) -> None:
        clock.advance(ttl)
        assert await store.get(key) is None

    yield Harness(store=store, expire=expire, now=clock)
    await store.aclose()


async def glide_client(url: str, cluster_ports: list[int] | None = None) -> Any:
    """A valkey-glide client on the standalone Redis at ``url`` or on a cluster's nodes."""
    from glide import (
        GlideClient,
        GlideClusterClient,
        GlideClusterClientConfiguration,
        NodeAddress,
    )

    from starlette_idempotency.stores.redis_glide import config_from_url

    if cluster_ports is None:
        return await GlideClient.create(config_from_url(url))
    nodes = [NodeAddress("127.0.0.1", port) for port in cluster_ports]
    return await GlideClusterClient.create(GlideClusterClientConfiguration(nodes))


def redis_backend(
    acquire: AcquireStrategy, *, cluster: bool = False, driver: DriverName = "redis-py"
) -> Factory:
    @contextlib.asynccontextmanager
    async def factory(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
        # ``admin`` (redis-py) cleans up; the store's own client comes from ``driver``.
        admin: aioredis.Redis | aioredis.RedisCluster
        if cluster:
            servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
            url = servers.url
            admin = aioredis.RedisCluster.from_url(url)
            ports: list[int] | None = servers.ports
        else:
            url = request.getfixturevalue("redis_url")
            admin = aioredis.from_url(url)
            ports = None
        client = admin if driver == "redis-py" else await glide_client(url, ports)
        prefix = unique_prefix()
        store = RedisStore(client, key_prefix=prefix, acquire=acquire)
        try:
            yield real_time_harness(store)
        finally:
            await store.aclose()
            await delete_prefixed(admin, prefix)
            if client is not admin:
                await client.close()
            await admin.aclose()

    return factory


@contextlib.asynccontextmanager
async def postgres_backend(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """A PostgresStore on a table of the test's own in this run's database."""
    store = await PostgresStore.connect(
        request.getfixturevalue("postgres_dsn"), table=request.getfixturevalue("postgres_table")
    )
    try:
        await store.create_schema()
        yield real_time_harness(store)
    finally:
        await store.aclose()


STORE_FACTORIES: list[Any] = [
    pytest.param(memory_backend, id="memory"),
    pytest.param(redis_backend("setnx"), id="redis-setnx", marks=pytest.mark.redis),
    pytest.param(redis_backend("lua"), id="redis-lua", marks=pytest.mark.redis),
    pytest.param(
        redis_backend("setnx", driver="glide"), id="redis-glide-setnx", marks=pytest.mark.redis
    ),
    pytest.param(
        redis_backend("lua", driver="glide"), id="redis-glide-lua", marks=pytest.mark.redis
    ),
    pytest.param(postgres_backend, id="postgres", marks=pytest.mark.postgres),
    pytest.param(
        redis_backend("setnx", cluster=True),
        id="redis-cluster-setnx",
        marks=[pytest.mark.redis, pytest.mark.cluster],
    ),
    pytest.param(
        redis_backend("lua", cluster=True),
        id="redis-cluster-lua",
        marks=[pytest.mark.redis, pytest.mark.cluster],
    ),
    pytest.param(
        redis_backend("setnx", cluster=True, driver="glide"),
        id="redis-glide-cluster-setnx",
        marks=[pytest.mark.redis, pytest.mark.cluster],
    ),
]


@pytest.fixture(params=STORE_FACTORIES)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    factory: Factory = request.param
    async with factory(request) as built:
        yield built


@pytest.fixture
def store(harness: Harness) -> IdempotencyStore:
    return harness.store


@pytest.fixture
def make_record(harness: Harness) -> Callable[..., IdempotencyRecord]:
    """Build an ``InProgress`` record (``owner_token`` required) on the store's clock."""

    def make(
        key: str, owner_token: str, *, fingerprint: str = "sha256:abc", lock_ttl: float = 30.0
    ) -> IdempotencyRecord:
        now = harness.now()
        return IdempotencyRecord(
            key=key,
            status=RecordStatus.IN_PROGRESS,
            request_fingerprint=fingerprint,
            owner_token=owner_token,
            created_at=now,
            expires_at=now + lock_ttl,
        )

    return make


def pending(key: str, owner_token: str, *, lock_ttl: float = 30.0) -> IdempotencyRecord:
    """An ``InProgress`` record on the wall clock (for real-time backends)."""
    now = time.time()
    return IdempotencyRecord(
        key=key,
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint="sha256:abc",
        owner_token=owner_token,
        created_at=now,
        expires_at=now + lock_ttl,
    )


async def poll(condition: Callable[[], Awaitable[bool]], what: str, within: float = 5.0) -> None:
    """Wait until ``condition()`` holds, checking every 10 ms; fail after ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while True:
                if await condition():
                    return
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out after {within}s waiting for {what}")


async def equals(value: Awaitable[Any], expected: Any) -> bool:
    """Whether ``value`` resolves to ``expected`` (a condition for :func:`poll`)."""
    return bool(await value == expected)


async def answers(store: IdempotencyStore) -> bool:
    """Whether ``store`` answers a read (a condition for :func:`poll` after an outage)."""
    try:
        await store.get("probe")
    except StoreError:
        return False
    return True


def finished(
    record: IdempotencyRecord,
    *,
    status: RecordStatus = RecordStatus.COMPLETED,
    body: bytes = b'{"ok": true}',
    ttl: float = 60.0,
) -> IdempotencyRecord:
    """``record`` moved to a final state with a small JSON response."""
    response = StoredResponse(
        status_code=201,
        headers=(("content-type", "application/json"), ("x-request", "1")),
        body=body,
        content_type="application/json",
    )
    return record.finished(status, response, record.created_at + ttl)


@pytest.fixture
async def admin(private_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A raw client on the private Redis, for INFO, CLIENT PAUSE and SCRIPT FLUSH."""
    raw = aioredis.from_url(private_redis.url)
    await raw.ping()
    yield raw
    await raw.aclose()


async def command_calls(admin: aioredis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = await admin.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name != "cmdstat_info"
    }


async def commands_sent(
    admin: aioredis.Redis, action: Callable[[], Awaitable[Any]]
) -> dict[str, int]:
    """The commands the server ran (name -> calls) while ``action`` ran, INFO excluded."""
    before = await command_calls(admin)
    await action()
    after = await command_calls(admin)
    return {
        name: calls - before.get(name, 0)
        for name, calls in after.items()
        if calls != before.get(name, 0)
    }
