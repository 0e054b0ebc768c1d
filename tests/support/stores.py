"""Every store backend behind one contract, each with its way to let time pass.

A backend factory takes the pytest request (to start only the servers it needs) and is an async
context manager yielding a :class:`ClockedStore`. Add a backend by appending one
``pytest.param`` to ``STORE_FACTORIES`` (``tests/stores/conftest.py`` runs the contract on each).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from examples.custom_store import DictStore

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores import IdempotencyRecord
from starlette_idempotency.stores.base import AcquireResult, IdempotencyStore
from starlette_idempotency.stores.memory import MemoryStore
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.testing import FakeClock
from starlette_idempotency.testing._isolation import delete_prefixed, unique_prefix
from starlette_idempotency.testing._redis_server import RedisClusterServers
from tests.support.conditions import eventually
from tests.support.records import LOCK_TTL

#: Every Redis acquire strategy, and every Redis driver, for tests that run on each.
STRATEGIES = pytest.mark.parametrize("acquire", ["setnx", "lua"])
DRIVERS = pytest.mark.parametrize("driver", ["redis-py", "glide"])

#: How long a real-time backend may take to drop a key after its TTL, before the test fails.
EXPIRY_GRACE_SECONDS = 5.0


@dataclass
class ClockedStore:
    """A store under test with its clock: how to make ``ttl`` seconds pass for one of its keys,
    and what time it is.

    ``expire(key, ttl)`` returns once ``store.get(key)`` is ``None``: a fake-clock backend
    advances its clock by ``ttl``; a real-time backend polls until the server dropped the key.
    ``now()`` is the time the store measures record times with.
    """

    store: IdempotencyStore
    expire: Callable[[str, float], Awaitable[None]]
    now: Callable[[], float]


Factory = Callable[[pytest.FixtureRequest], contextlib.AbstractAsyncContextManager[ClockedStore]]


def real_time_store(store: IdempotencyStore) -> ClockedStore:
    """A :class:`ClockedStore` for a store whose TTLs run on the server's clock."""

    async def expire(key: str, ttl: float) -> None:
        async def dropped() -> bool:
            return await store.get(key) is None

        await eventually(
            dropped,
            timeout=ttl + EXPIRY_GRACE_SECONDS,
            interval=0.02,
            message=f"{key!r} to be dropped after its {ttl}s TTL",
        )

    return ClockedStore(store=store, expire=expire, now=time.time)


def fake_clock_backend(build: Callable[[FakeClock], IdempotencyStore]) -> Factory:
    """A backend of the store ``build`` makes on a fake clock, whose TTLs pass at once."""

    @contextlib.asynccontextmanager
    async def factory(request: pytest.FixtureRequest) -> AsyncIterator[ClockedStore]:
        clock = FakeClock()
        store = build(clock)

        async def expire(key: str, ttl: float) -> None:
            clock.advance(ttl)
            assert await store.get(key) is None

        yield ClockedStore(store=store, expire=expire, now=clock)
        await store.aclose()

    return factory


async def glide_client(url: str, cluster_ports: list[int] | None = None) -> Any:
    """A valkey-glide client on the standalone Redis at ``url`` or on a cluster's nodes."""
    from glide import (
        GlideClient,
        GlideClusterClient,
        GlideClusterClientConfiguration,
        NodeAddress,
    )

    from starlette_idempotency.stores.redis._glide import config_from_url

    if cluster_ports is None:
        return await GlideClient.create(config_from_url(url))
    nodes = [NodeAddress("127.0.0.1", port) for port in cluster_ports]
    return await GlideClusterClient.create(GlideClusterClientConfiguration(nodes))


def redis_backend(
    acquire: AcquireStrategy, *, cluster: bool = False, driver: DriverName = "redis-py"
) -> Factory:
    @contextlib.asynccontextmanager
    async def factory(request: pytest.FixtureRequest) -> AsyncIterator[ClockedStore]:
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
            yield real_time_store(store)
        finally:
            await store.aclose()
            await delete_prefixed(admin, prefix)
            if client is not admin:
                await client.close()
            await admin.aclose()

    return factory


@contextlib.asynccontextmanager
async def postgres_backend(request: pytest.FixtureRequest) -> AsyncIterator[ClockedStore]:
    """A PostgresStore on a table of the test's own in this run's database, built as an app
    builds it at import time (its pool opened by its first operation)."""
    store = PostgresStore.from_dsn(
        request.getfixturevalue("postgres_dsn"), table=request.getfixturevalue("postgres_table")
    )
    try:
        await store.create_schema()
        yield real_time_store(store)
    finally:
        await store.aclose()


def require_recovery(store: IdempotencyStore) -> None:
    """Skip a test of recovery points on a store that keeps none."""
    if not getattr(store, "supports_recovery", False):
        pytest.skip(f"{type(store).__name__} keeps no recovery points")


STORE_FACTORIES: list[Any] = [
    pytest.param(fake_clock_backend(lambda clock: MemoryStore(clock=clock)), id="memory"),
    # The store of your own that docs/how-to/choose-a-store.md shows.
    pytest.param(fake_clock_backend(lambda clock: DictStore(clock=clock)), id="custom-example"),
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


async def equals(value: Awaitable[Any], expected: Any) -> bool:
    """Whether ``value`` resolves to ``expected`` (a condition for ``eventually``)."""
    return bool(await value == expected)


async def answers(store: IdempotencyStore) -> bool:
    """Whether ``store`` answers a read (a condition for ``eventually`` after an outage)."""
    try:
        await store.get("probe")
    except StoreError:
        return False
    return True


async def command_calls(admin: aioredis.Redis) -> dict[str, int]:
    """The commands the server ran so far (name -> calls), INFO excluded."""
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


def replica_waiting_store(
    client: Any, prefix: str, acquire: AcquireStrategy, *, wait_timeout_ms: int
) -> RedisStore:
    """A RedisStore that waits up to ``wait_timeout_ms`` for one replica to acknowledge."""
    return RedisStore(
        client, key_prefix=prefix, acquire=acquire, wait_replicas=1, wait_timeout_ms=wait_timeout_ms
    )


async def timed_acquire(
    store: RedisStore, record: IdempotencyRecord, caplog: pytest.LogCaptureFixture
) -> tuple[AcquireResult, float]:
    """``store`` acquires ``record``'s key, its warnings captured in ``caplog``: the result, and
    the seconds it took."""
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency.stores.redis"):
        started = time.monotonic()
        result = await store.try_acquire(record.key, record, LOCK_TTL)
        elapsed = time.monotonic() - started
    return result, elapsed
