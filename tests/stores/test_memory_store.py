"""MemoryStore specifics beyond the contract: what its self-check says, records kept out of
the garbage collector's walk, and a lock just acquired held as its record."""

from __future__ import annotations

import gc
from dataclasses import replace

from starlette_idempotency._record import Checkpoint, IdempotencyRecord
from starlette_idempotency.stores.base import CheckableStore
from starlette_idempotency.stores.memory import MemoryStore
from starlette_idempotency.testing import FakeClock
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


class _RecoveredMeanwhile(MemoryStore):
    """A MemoryStore on which, right after the next ``get``, a retry (``owner-b``) recovers
    the key, saves a further point (kept an hour) and dies: between what ``delete`` or
    ``resolve`` looked at and its takeover."""

    armed = True

    async def get(self, key: str) -> IdempotencyRecord | None:
        seen = await super().get(key)
        if self.armed:
            self.armed = False
            retry = await self.try_acquire(key, pending(key, "owner-b"), 30)
            assert retry.acquired
            assert retry.record is not None
            point = Checkpoint("refund_sent", {"n": 2}, self._clock())
            again = replace(retry.record, owner_token="owner-b")
            again = replace(again, checkpoints=(*again.checkpoints, point))
            assert await self.save_progress(key, again, 3600, 0)
        return seen


async def test_a_record_given_back_keeps_its_retention() -> None:
    """``delete`` with the token looked at gives back the retry's record it took over: for a
    retry to recover at once, and kept for the hour the retry saved it for, not for the few
    seconds the takeover held it."""
    clock = FakeClock()
    store = _RecoveredMeanwhile(clock=clock)
    first = pending("k", "owner-a", now=clock())
    assert (await store.try_acquire("k", first, 30)).acquired
    saved = replace(first, checkpoints=(Checkpoint("provider_charge_sent", {"n": 1}, clock()),))
    assert await store.save_progress("k", saved, 3600, 0)

    assert not await store.delete("k", owner_token="owner-a")

    clock.advance(3000)
    retry = await store.try_acquire("k", pending("k", "owner-c", now=clock()), 30)
    assert retry.acquired, "the record given back went before its retention ended"
    assert retry.record is not None
    assert [point.name for point in retry.record.checkpoints] == [
        "provider_charge_sent",
        "refund_sent",
    ]
