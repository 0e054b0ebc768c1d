"""MemoryStore specifics beyond the contract: what its self-check says, and records kept out
of the garbage collector's walk."""

from __future__ import annotations

import gc

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
