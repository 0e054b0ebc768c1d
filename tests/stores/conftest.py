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

from starlette_idempotency.record import IdempotencyRecord, RecordStatus, StoredResponse
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.memory import MemoryStore
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.stores.redis import AcquireStrategy, RedisStore
from starlette_idempotency.testing import FakeClock
from starlette_idempotency.testing.redis_server import RedisClusterServers
from tests.plugins.redis_servers import delete_prefixed, unique_prefix

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


def redis_backend(acquire: AcquireStrategy, *, cluster: bool = False) -> Factory:
    @contextlib.asynccontextmanager
    async def factory(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
        client: aioredis.Redis | aioredis.RedisCluster
        if cluster:
            servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
            client = aioredis.RedisCluster.from_url(servers.url)
        else:
            client = aioredis.from_url(request.getfixturevalue("redis_url"))
        prefix = unique_prefix()
        store = RedisStore(client, key_prefix=prefix, acquire=acquire)
        try:
            yield real_time_harness(store)
        finally:
            await store.aclose()
            await delete_prefixed(client, prefix)
            await client.aclose()

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
