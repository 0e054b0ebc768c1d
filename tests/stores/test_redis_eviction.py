"""A held key that vanishes: evicted under ``maxmemory``, or deleted by an operator.

The owner finds out when it renews; taking the key back with its own record works, and a
final write over a key that vanished again is stored and answered ``RECLAIMED``. (What the
middleware does with that, through a real server, is tested with the engine.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Literal

import pytest
import redis.asyncio as aioredis

from starlette_idempotency._record import RecordStatus
from starlette_idempotency.stores.base import FencedWrite
from starlette_idempotency.stores.redis import DriverName, RedisStore
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.records import LOCK_TTL, RETENTION_TTL, finished, pending
from tests.support.stores import DRIVERS

pytestmark = pytest.mark.redis

Vanish = Literal["evicted", "deleted"]

FILLER = b"x" * 100_000
#: 100 MB of filler at most, 25 times maxmemory: far more than evicting one key takes.
MAX_FILLERS = 1000


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A Redis that evicts any key, least recently used first, once 4 MB are used."""
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(extra_args=args) as started:
        yield started


@pytest.fixture
async def admin(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(server.url)
    yield client
    await client.aclose()


async def vanish(admin: aioredis.Redis, key: str, how: Vanish) -> None:
    """Make ``key`` disappear: fill memory until Redis evicts it, or DEL it."""
    if how == "deleted":
        assert await admin.delete(key) == 1
        return
    for n in range(MAX_FILLERS):
        if not await admin.exists(key):
            return
        await admin.set(f"filler:{n}", FILLER)
    pytest.fail(f"{key!r} survived {MAX_FILLERS} fillers of {len(FILLER)} bytes")


@pytest.mark.parametrize("how", ["evicted", "deleted"])
@DRIVERS
async def test_a_vanished_lock_is_noticed_taken_back_and_reclaimed(
    server: RedisServer, admin: aioredis.Redis, driver: DriverName, how: Vanish
) -> None:
    store = RedisStore.from_url(server.url, key_prefix="p", driver=driver)
    try:
        record = pending("k", "owner-a")
        assert (await store.try_acquire("k", record, LOCK_TTL)).acquired

        await vanish(admin, "p:k", how)

        assert not await store.renew("k", "owner-a", LOCK_TTL)
        back = await store.try_acquire("k", record, LOCK_TTL, recover=False)
        assert back.acquired
        assert back.record is None
        assert await store.renew("k", "owner-a", LOCK_TTL)  # held again

        await vanish(admin, "p:k", how)

        done = finished(record)
        assert await store.finish("k", done, RETENTION_TTL) is FencedWrite.RECLAIMED
        stored = await store.get("k")
        assert stored is not None
        assert stored.status is RecordStatus.COMPLETED
        assert stored.response == done.response
        replay = await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)
        assert not replay.acquired
        assert replay.record is not None
        assert replay.record.response == done.response
        if how == "evicted":
            info = await admin.info("stats")
            assert int(info["evicted_keys"]) > 0
    finally:
        await store.aclose()
