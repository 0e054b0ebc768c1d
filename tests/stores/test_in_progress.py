"""``in_progress()`` of RedisStore and PostgresStore: the records of the store's own prefix, a
lease judged on the store's clock, finished records left out."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from starlette_idempotency.stores import Checkpoint, HeldRecord
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.stores.redis import RedisStore
from starlette_idempotency.testing._isolation import delete_prefixed_at, unique_prefix
from tests.support.records import LOCK_TTL, RETENTION_TTL, finished, pending

Stores = tuple[RedisStore, RedisStore] | tuple[PostgresStore, PostgresStore]


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[Stores]:
    """Two stores on one server whose prefixes a careless match would mix up: ``<p>[x]`` is a
    glob that matches ``<p>x``, and ``<p>`` is where ``<p>x`` starts."""
    base = unique_prefix()
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        pair: Stores = (
            RedisStore.from_url(url, key_prefix=f"{base}[x]"),
            RedisStore.from_url(url, key_prefix=f"{base}x"),
        )
    else:
        dsn, table = (
            request.getfixturevalue("postgres_dsn"),
            request.getfixturevalue("postgres_table"),
        )
        pair = (
            PostgresStore.from_dsn(dsn, table=table, key_prefix=base),
            PostgresStore.from_dsn(dsn, table=table, key_prefix=f"{base}x"),
        )
        await pair[0].create_schema()
    yield pair
    for store in pair:
        await store.aclose()
    if request.param == "redis":
        for prefix in (f"{base}[x]", f"{base}x"):
            await delete_prefixed_at(url, prefix)


async def hold(store: RedisStore | PostgresStore, key: str, lease: float) -> None:
    """A record in progress with a recovery point and a lease of ``lease`` seconds."""
    record = pending(key)
    assert (await store.try_acquire(key, record, LOCK_TTL)).acquired
    point = replace(record, checkpoints=(Checkpoint("sent", {"ref": key}, record.created_at),))
    assert await store.save_progress(key, point, RETENTION_TTL, lease)


async def test_only_the_store_prefix_and_the_lease_on_the_store_clock(stores: Stores) -> None:
    mine, other = stores
    await hold(mine, "a:POST:/charges:dead", lease=0)
    await hold(mine, "a:POST:/charges:alive", lease=60)
    plain = pending("a:POST:/payments:running")
    assert (await mine.try_acquire(plain.key, plain, LOCK_TTL)).acquired
    done = pending("a:POST:/payments:done")
    assert (await mine.try_acquire(done.key, done, LOCK_TTL)).acquired
    assert await mine.finish(done.key, finished(done), RETENTION_TTL)
    await hold(other, "a:POST:/charges:elsewhere", lease=0)

    listed = await mine.in_progress()
    assert {held.key for held in listed} == {
        "a:POST:/charges:dead",
        "a:POST:/charges:alive",
        "a:POST:/payments:running",
    }
    [stuck] = await mine.in_progress(stuck=True)
    assert stuck == HeldRecord("a:POST:/charges:dead", stuck.record, lease_expired=True)
    assert stuck.record.checkpoints[0].data == {"ref": "a:POST:/charges:dead"}
    assert [held.key for held in await other.in_progress(stuck=True)] == [
        "a:POST:/charges:elsewhere"
    ]
    assert len(await mine.in_progress(limit=2)) == 2
