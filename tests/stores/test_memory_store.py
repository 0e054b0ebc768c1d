"""MemoryStore specifics beyond the contract: what its self-check says, records kept out of
the garbage collector's walk, and a lock just acquired held as its record."""

from __future__ import annotations

import gc
from dataclasses import replace

from starlette_idempotency._record import Checkpoint
from starlette_idempotency.stores.base import CheckableStore
from starlette_idempotency.stores.memory import MemoryStore
from tests.support.records import finished, pending


async def test_the_memory_store_describes_itself_as_this_process_only() -> None:
    store = MemoryStore()

    assert isinstance(store, CheckableStore)
    assert store.describe() == "memory (this process only)"
    assert await store.check() == []


async def test_stored_records_add_nothing_to_the_garbage_collectors_walk() -> None:
    store = MemoryStore()
    gc.collect()
    tracked_before = len(gc.get_objects())

    for n in range(2000):
        key = f"k{n}"
        held = pending(key)
        assert (await store.try_acquire(key, held, 30)).acquired
        assert await store.finish(key, finished(held), 3600)
    gc.collect()

    assert len(store) == 2000
    # A few objects of the loop itself at most: as objects, each record was several.
    assert len(gc.get_objects()) - tracked_before < 100


async def test_a_record_reads_back_as_it_was_written() -> None:
    store = MemoryStore()
    held = pending("k")
    await store.try_acquire("k", held, 30)
    done = finished(held)
    await store.finish("k", done, 3600)

    assert await store.get("k") == done
    assert store.records() == {"k": done}


async def test_a_lock_just_acquired_reads_back_until_it_is_settled() -> None:
    store = MemoryStore()
    held = pending("k")
    assert (await store.try_acquire("k", held, 30)).acquired

    conflict = await store.try_acquire("k", pending("k", "owner-b"), 30)
    assert not conflict.acquired
    assert conflict.record == held
    assert await store.renew("k", held.owner_token, 30)
    assert await store.get("k") == held


async def test_recovery_points_are_copied_when_a_lock_is_acquired_with_them() -> None:
    # Their data is the caller's: what the store keeps must not follow later changes to it.
    store = MemoryStore()
    data = {"charge": "ch_1"}
    held = replace(pending("k"), checkpoints=(Checkpoint("charged", data, 1.0),))
    assert (await store.try_acquire("k", held, 30)).acquired

    data["charge"] = "changed"

    kept = await store.get("k")
    assert kept is not None
    assert kept.checkpoints[0].data == {"charge": "ch_1"}
