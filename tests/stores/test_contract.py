"""The store contract, run against every backend in ``STORE_FACTORIES`` (see conftest).

Times: a fake-clock backend jumps its clock; a real-time backend uses short TTLs and waits for
the key to disappear (``harness.expire``), so the same test bodies cover both.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from http import HTTPStatus

import orjson
import pytest

from starlette_idempotency._record import (
    Checkpoint,
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    record_to_dict,
)
from starlette_idempotency.stores.base import (
    AcquireResult,
    CheckableStore,
    FencedWrite,
    IdempotencyStore,
    StoreBase,
    take_back,
)
from tests.support.records import LOCK_TTL, RETENTION_TTL, finished
from tests.support.stores import ClockedStore, require_recovery

#: A lock or retention TTL short enough to wait out on a real server.
SHORT_TTL = 0.3

MakeRecord = Callable[..., IdempotencyRecord]


def assert_same(actual: IdempotencyRecord | None, expected: IdempotencyRecord) -> None:
    """Equal as stored: wire forms compare (times are kept to the millisecond)."""
    assert actual is not None
    assert record_to_dict(actual) == record_to_dict(expected)


async def held(
    store: IdempotencyStore, make_record: MakeRecord, lock_ttl: float = LOCK_TTL
) -> IdempotencyRecord:
    """``owner-a``'s record for ``k1``, after ``store`` was asked to acquire it."""
    record = make_record("k1", "owner-a")
    await store.try_acquire("k1", record, lock_ttl)
    return record


async def test_store_implements_the_protocol(store: IdempotencyStore) -> None:
    assert isinstance(store, IdempotencyStore)
    assert isinstance(store.name, str)
    assert store.name


async def test_a_reachable_store_checks_itself_without_errors(store: IdempotencyStore) -> None:
    assert isinstance(store, CheckableStore)
    assert store.describe()
    findings = await store.check()
    assert all(finding.level == "warning" for finding in findings), findings


async def test_get_absent_key(store: IdempotencyStore) -> None:
    assert await store.get("never-written") is None


async def test_acquire_free_key(store: IdempotencyStore, make_record: MakeRecord) -> None:
    pending = make_record("k1", "owner-a")

    result = await store.try_acquire("k1", pending, LOCK_TTL)

    assert result.acquired
    assert result.record is None
    assert_same(await store.get("k1"), pending)


async def test_conflict_returns_the_holder(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    first = make_record("k1", "owner-a", fingerprint="sha256:first")
    await store.try_acquire("k1", first, LOCK_TTL)

    result = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)

    assert not result.acquired
    assert_same(result.record, first)
    assert_same(await store.get("k1"), first)


async def test_complete_then_conflict_returns_the_response(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)
    done = finished(pending)

    assert await store.finish("k1", done, RETENTION_TTL)

    assert_same(await store.get("k1"), done)
    result = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert not result.acquired
    assert result.record is not None
    assert result.record.status is RecordStatus.COMPLETED
    assert result.record.response == done.response


async def test_fail_stores_a_failed_record(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)
    failed = finished(pending, status=RecordStatus.FAILED, body=b'{"error": "card declined"}')

    assert await store.finish("k1", failed, RETENTION_TTL)

    stored = await store.get("k1")
    assert_same(stored, failed)
    assert stored is not None
    assert stored.status is RecordStatus.FAILED


async def test_release_frees_the_key(store: IdempotencyStore, make_record: MakeRecord) -> None:
    await store.try_acquire("k1", make_record("k1", "owner-a"), LOCK_TTL)
    await store.try_acquire("k2", make_record("k2", "owner-c"), LOCK_TTL)

    assert await store.release("k1", "owner-a")

    assert await store.get("k1") is None
    assert await store.get("k2") is not None, "release touched another key"
    assert (await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)).acquired


async def test_release_of_an_absent_key_succeeds(store: IdempotencyStore) -> None:
    assert await store.release("k1", "owner-a")


async def test_release_by_another_owner_keeps_the_lock(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)

    assert not await store.release("k1", "owner-b")

    assert_same(await store.get("k1"), pending)


async def test_final_record_expires_after_its_ttl(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)
    assert await store.finish("k1", finished(pending), SHORT_TTL)

    await harness.expire("k1", SHORT_TTL)

    assert await store.get("k1") is None
    assert (await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)).acquired


async def test_expired_lock_is_taken_over(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    await store.try_acquire("k1", make_record("k1", "owner-a"), SHORT_TTL)

    await harness.expire("k1", SHORT_TTL)
    successor = make_record("k1", "owner-b")
    result = await store.try_acquire("k1", successor, LOCK_TTL)

    assert result.acquired
    assert_same(await store.get("k1"), successor)


async def test_old_owner_is_fenced_off_after_a_takeover(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    old = await held(store, make_record, SHORT_TTL)
    await harness.expire("k1", SHORT_TTL)
    successor = make_record("k1", "owner-b")
    assert (await store.try_acquire("k1", successor, LOCK_TTL)).acquired

    assert await store.finish("k1", finished(old), RETENTION_TTL) is FencedWrite.LOST
    failed = finished(old, status=RecordStatus.FAILED)
    assert await store.finish("k1", failed, RETENTION_TTL) is FencedWrite.LOST
    assert not await store.release("k1", "owner-a")
    assert not await store.renew("k1", "owner-a", LOCK_TTL)

    assert_same(await store.get("k1"), successor)
    assert await store.finish("k1", finished(successor), RETENTION_TTL) is FencedWrite.WRITTEN


async def test_complete_after_the_lock_lapsed_with_nobody_else(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record, SHORT_TTL)
    await harness.expire("k1", SHORT_TTL)
    done = finished(pending)

    assert await store.finish("k1", done, RETENTION_TTL) is FencedWrite.RECLAIMED

    assert_same(await store.get("k1"), done)


@pytest.mark.parametrize("status", [RecordStatus.COMPLETED, RecordStatus.FAILED])
async def test_a_final_write_by_the_owner_is_written(
    store: IdempotencyStore, make_record: MakeRecord, status: RecordStatus
) -> None:
    pending = await held(store, make_record)
    final = finished(pending, status=status)
    write = store.finish

    assert await write("k1", final, RETENTION_TTL) is FencedWrite.WRITTEN

    assert_same(await store.get("k1"), final)


@pytest.mark.parametrize("status", [RecordStatus.COMPLETED, RecordStatus.FAILED])
async def test_a_final_write_over_a_vanished_key_is_reclaimed(
    store: IdempotencyStore, make_record: MakeRecord, status: RecordStatus
) -> None:
    """The key is gone while its owner still runs (evicted, deleted by an operator; here it was
    released, as the store cannot tell those apart): the owner writes it back, and says so."""
    pending = await held(store, make_record)
    assert await store.release("k1", "owner-a")
    final = finished(pending, status=status)
    write = store.finish

    assert await write("k1", final, RETENTION_TTL) is FencedWrite.RECLAIMED

    assert_same(await store.get("k1"), final)
    assert not (await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)).acquired


async def test_the_holder_acquiring_again_keeps_the_key(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """The owner taking back a key it still holds (after a renewal went wrong, or a resent
    acquire) has acquired it; the record stays as it was."""
    pending = await held(store, make_record)

    again = await store.try_acquire("k1", make_record("k1", "owner-a"), LOCK_TTL, recover=False)

    assert again.acquired
    assert again.record is None
    assert_same(await store.get("k1"), pending)
    assert not (await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)).acquired
    assert await store.finish("k1", finished(pending), RETENTION_TTL) is FencedWrite.WRITTEN


async def test_the_owner_acquiring_a_vanished_key_takes_it_back(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)
    assert await store.release("k1", "owner-a")  # as if evicted

    back = await store.try_acquire("k1", pending, LOCK_TTL, recover=False)

    assert back.acquired
    assert await store.renew("k1", "owner-a", LOCK_TTL)
    assert await store.finish("k1", finished(pending), RETENTION_TTL) is FencedWrite.WRITTEN


async def test_a_finished_record_is_not_held_by_its_owner(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """Only an ``InProgress`` record is held: the owner acquiring again after it finished gets
    the conflict (and its own response), not a lock."""
    pending = await held(store, make_record)
    done = finished(pending)
    await store.finish("k1", done, RETENTION_TTL)

    again = await store.try_acquire("k1", make_record("k1", "owner-a"), LOCK_TTL, recover=False)

    assert not again.acquired
    assert_same(again.record, done)


async def test_renewed_lock_outlives_its_first_ttl(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    renewed = make_record("renewed", "owner-a")
    await store.try_acquire("renewed", renewed, SHORT_TTL)
    await store.try_acquire("control", make_record("control", "owner-c"), SHORT_TTL)

    assert await store.renew("renewed", "owner-a", LOCK_TTL)
    await harness.expire("control", SHORT_TTL)  # the first TTL of both locks has passed

    assert_same(await store.get("renewed"), renewed)
    result = await store.try_acquire("renewed", make_record("renewed", "owner-b"), LOCK_TTL)
    assert not result.acquired


async def test_renew_needs_an_in_progress_record_of_the_same_owner(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    assert not await store.renew("absent", "owner-a", LOCK_TTL)

    pending = await held(store, make_record)
    assert not await store.renew("k1", "owner-b", LOCK_TTL)
    assert await store.renew("k1", "owner-a", LOCK_TTL)

    assert await store.finish("k1", finished(pending), RETENTION_TTL)
    assert not await store.renew("k1", "owner-a", LOCK_TTL)


async def test_binary_body_round_trips_byte_for_byte(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    body = bytes(range(256)) + b"\xff\xfe\x00 not utf-8 \xc3\x28"
    pending = await held(store, make_record)
    done = finished(pending, body=body)

    assert await store.finish("k1", done, RETENTION_TTL)

    stored = await store.get("k1")
    assert stored is not None
    assert stored.response is not None
    assert stored.response.body == body
    conflict = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert conflict.record is not None
    assert conflict.record.response is not None
    assert conflict.record.response.body == body


async def test_keys_with_colons_and_unicode(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    key = "POST:/orders/%7Bid%7D:tenant%3A42:ключ-🔑-キー"
    sibling = "POST:/orders/%7Bid%7D:tenant%3A42"
    pending = make_record(key, "owner-a")

    assert (await store.try_acquire(key, pending, LOCK_TTL)).acquired
    assert (await store.try_acquire(sibling, make_record(sibling, "owner-b"), LOCK_TTL)).acquired

    assert_same(await store.get(key), pending)
    assert await store.finish(key, finished(pending), RETENTION_TTL)
    stored_sibling = await store.get(sibling)
    assert stored_sibling is not None
    assert stored_sibling.owner_token == "owner-b"
    assert await store.release(sibling, "owner-b")
    assert_same(await store.get(key), finished(pending))


async def test_acquire_result_shape(store: IdempotencyStore, make_record: MakeRecord) -> None:
    result = await store.try_acquire("k1", make_record("k1", "owner-a"), LOCK_TTL)
    assert isinstance(result, AcquireResult)
    conflict = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert isinstance(conflict, AcquireResult)
    assert conflict.record is not None
    assert conflict.record.owner_token == "owner-a"


# -- recovery points (save_progress, takeover of a checkpointed record) ------------------------

#: Checkpoint data as a handler might save it: empty containers, floats, unicode, and a nested
#: "ownerToken" that must never be mistaken for the record's own.
CHECKPOINT_DATA = {
    "providerRef": "ch_1",
    "amount": 12.5,
    "items": [],
    "meta": {},
    "nested": [{"ownerToken": "spoof", "lockedUntil": 0}],
    "note": "ключ 🔑",
}


def checkpointed(record: IdempotencyRecord, now: float) -> IdempotencyRecord:
    """``record`` with one more recovery point, kept for the retention time."""
    point = Checkpoint("provider_charge_sent", CHECKPOINT_DATA, now)
    return replace(record, checkpoints=(*record.checkpoints, point), expires_at=now + RETENTION_TTL)


def assert_same_but_lease(actual: IdempotencyRecord | None, expected: IdempotencyRecord) -> None:
    """Equal as stored, but for the lease, which the store sets on its own clock."""
    assert actual is not None
    assert_same(replace(actual, locked_until=None), replace(expected, locked_until=None))


async def test_save_progress_by_the_owner(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = await held(store, make_record)
    saved = checkpointed(pending, harness.now())

    assert await store.save_progress("k1", saved, RETENTION_TTL, LOCK_TTL)

    stored = await store.get("k1")
    assert_same_but_lease(stored, saved)
    assert stored is not None
    assert stored.checkpoints[0].data == CHECKPOINT_DATA
    assert stored.locked_until is not None  # the lease the store keeps, shown in its record
    intruder = replace(checkpointed(pending, harness.now()), owner_token="owner-b")
    assert not await store.save_progress("k1", intruder, RETENTION_TTL, LOCK_TTL)
    assert_same(await store.get("k1"), stored)


class Stage(enum.StrEnum):
    CHARGED = "charged"


#: Checkpoint data JSON writes in a form of its own, and that form: what every store reads back.
JSON_WRITTEN = {
    "stage": Stage.CHARGED,
    "status": HTTPStatus.ACCEPTED,
    "charge": uuid.UUID(int=1),
    "at": datetime(2026, 11, 30, 10, 0, tzinfo=UTC),
    "pair": ("ch_1", 1),
    "nan": float("nan"),
}
JSON_READ = {
    "stage": "charged",
    "status": 202,
    "charge": "00000000-0000-0000-0000-000000000001",
    "at": "2026-11-30T10:00:00+00:00",
    "pair": ["ch_1", 1],
    "nan": None,
}


async def test_checkpoint_data_reads_back_as_json_reads_it(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """An app moving from one store to another finds its recovery data as it was: each keeps
    it as JSON, so enum members, UUIDs and datetimes are saved and read back as JSON writes
    them (MemoryStore once refused them)."""
    require_recovery(store)
    pending = await held(store, make_record)
    point = Checkpoint(Stage.CHARGED, JSON_WRITTEN, harness.now())

    assert await store.save_progress(
        "k1", replace(pending, checkpoints=(point,)), RETENTION_TTL, LOCK_TTL
    )

    stored = await store.get("k1")
    assert stored is not None
    [kept] = stored.checkpoints
    assert type(kept.name) is str
    assert kept.name == "charged"
    assert kept.data == JSON_READ


@pytest.mark.parametrize(
    "data", [object(), {1: "one"}, 2**64], ids=["object", "int-key", "beyond-64-bits"]
)
async def test_checkpoint_data_json_cannot_hold_is_refused(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord, data: object
) -> None:
    """Refused alike by every store, and nothing written: the middleware turns the error into
    a ``StoreError`` for the handler, which then does not go on with its side effect."""
    require_recovery(store)
    pending = await held(store, make_record)
    point = Checkpoint("provider_charge_sent", data, harness.now())

    with pytest.raises(orjson.JSONEncodeError):
        await store.save_progress(
            "k1", replace(pending, checkpoints=(point,)), RETENTION_TTL, LOCK_TTL
        )

    assert_same(await store.get("k1"), pending)


async def test_save_progress_needs_a_live_record(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    pending = make_record("k1", "owner-a")

    assert not await store.save_progress("k1", checkpointed(pending, harness.now()), 60, 0)

    assert await store.get("k1") is None


@pytest.mark.parametrize("status", [RecordStatus.COMPLETED, RecordStatus.FAILED])
async def test_no_progress_or_renewal_reopens_a_finished_record(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord, status: RecordStatus
) -> None:
    """A late write of the owner (a checkpoint from a task that runs after the response, a
    renewal or a command resent after a reconnect) never turns its final record back."""
    pending = await held(store, make_record)
    assert await store.save_progress("k1", checkpointed(pending, harness.now()), 60, LOCK_TTL)
    final = finished(checkpointed(pending, harness.now()), status=status)
    assert await store.finish("k1", final, RETENTION_TTL) is FencedWrite.WRITTEN

    late = checkpointed(checkpointed(pending, harness.now()), harness.now())
    assert not await store.save_progress("k1", late, RETENTION_TTL, LOCK_TTL)
    assert not await store.save_progress("k1", late, RETENTION_TTL, 0)
    assert not await store.renew("k1", "owner-a", LOCK_TTL)

    assert_same(await store.get("k1"), final)
    replay = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert not replay.acquired
    assert_same(replay.record, final)


async def test_a_dead_handlers_checkpoints_are_taken_over(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    require_recovery(store)
    dead = await held(store, make_record)
    saved = checkpointed(dead, harness.now())
    assert await store.save_progress("k1", saved, RETENTION_TTL, 0)  # the lease ends now
    stored_dead = await store.get("k1")
    assert stored_dead is not None

    result = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)

    assert result.acquired
    assert_same(result.record, stored_dead)
    stored = await store.get("k1")
    assert stored is not None
    assert stored.owner_token == "owner-b"
    assert stored.status is RecordStatus.IN_PROGRESS
    assert stored.locked_until is not None
    assert stored.locked_until > harness.now()
    # Apart from the owner and the lease, the record is the one taken over (checkpoints too).
    assert_same_but_lease(replace(stored, owner_token="owner-a"), saved)
    # The successor acquiring again (taking its key back) keeps the checkpoints it inherited.
    again = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL, recover=False)
    assert again.acquired
    assert_same(again.record, stored)
    # The dead handler is fenced off; its successor finishes.
    assert not await store.finish("k1", finished(saved), RETENTION_TTL)
    assert not await store.save_progress("k1", saved, RETENTION_TTL, LOCK_TTL)
    assert not await store.renew("k1", "owner-a", LOCK_TTL)
    assert not await store.release("k1", "owner-a")
    busy = await store.try_acquire("k1", make_record("k1", "owner-c"), LOCK_TTL)
    assert not busy.acquired
    assert busy.lease_expired is False
    assert await store.finish("k1", finished(stored), RETENTION_TTL)


async def test_a_running_owner_takes_back_what_its_successor_kept_for_recovery(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """``owner-a`` was frozen past its lease; ``owner-b`` recovered the key, saved another
    point and failed, ending its lease for a retry. ``owner-a``, awake and still running,
    takes the key back rather than leave it for a retry to recover beside it."""
    require_recovery(store)
    first = await held(store, make_record)
    assert await store.save_progress("k1", checkpointed(first, harness.now()), RETENTION_TTL, 0)
    successor = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert successor.acquired
    assert successor.record is not None
    kept = checkpointed(replace(successor.record, owner_token="owner-b"), harness.now())
    assert await store.save_progress("k1", kept, RETENTION_TTL, 0)

    back = await take_back(store, "k1", first, LOCK_TTL)

    assert back.acquired
    assert back.record is not None
    assert len(back.record.checkpoints) == 2
    assert not await store.renew("k1", "owner-b", LOCK_TTL)
    assert await store.renew("k1", "owner-a", LOCK_TTL)
    busy = await store.try_acquire("k1", make_record("k1", "owner-c"), LOCK_TTL)
    assert not busy.acquired
    assert busy.lease_expired is False


async def test_a_checkpointed_record_is_not_taken_over_when(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    require_recovery(store)
    now = harness.now()
    live = make_record("live", "owner-a")
    await store.try_acquire("live", live, LOCK_TTL)
    assert await store.save_progress("live", checkpointed(live, now), RETENTION_TTL, LOCK_TTL)
    dead = make_record("dead", "owner-a")
    await store.try_acquire("dead", dead, LOCK_TTL)
    assert await store.save_progress("dead", checkpointed(dead, now), RETENTION_TTL, 0)
    live_saved, dead_saved = await store.get("live"), await store.get("dead")
    assert live_saved is not None
    assert dead_saved is not None

    lease_running = await store.try_acquire("live", make_record("live", "owner-b"), LOCK_TTL)
    other_request = await store.try_acquire(
        "dead", make_record("dead", "owner-b", fingerprint="sha256:other"), LOCK_TTL
    )
    declined = await store.try_acquire(
        "dead", make_record("dead", "owner-b"), LOCK_TTL, recover=False
    )

    for result, holder, expired in [
        (lease_running, live_saved, False),
        (other_request, dead_saved, True),
        (declined, dead_saved, True),
    ]:
        assert not result.acquired
        assert_same(result.record, holder)
        assert result.lease_expired is expired  # judged by the store, on its own clock
    assert_same(await store.get("dead"), dead_saved)


async def test_a_lease_is_counted_on_the_stores_clock_not_the_records_times(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """Records made on pods whose clocks are an hour off either way: the lease the store
    keeps runs from when it was saved, whatever the times inside the record say."""
    require_recovery(store)
    for key, skew in [("behind", -3600.0), ("ahead", 3600.0)]:
        pod_now = harness.now() + skew
        mine = pending_at(make_record(key, "owner-a"), pod_now)
        assert (await store.try_acquire(key, mine, LOCK_TTL)).acquired
        assert await store.save_progress(key, checkpointed(mine, pod_now), RETENTION_TTL, LOCK_TTL)
        retry = pending_at(make_record(key, "owner-b"), harness.now() - skew)

        result = await store.try_acquire(key, retry, LOCK_TTL)

        assert not result.acquired, f"a pod {skew:+.0f} s off took over a running handler"
        assert result.lease_expired is False
        assert await store.renew(key, "owner-a", LOCK_TTL)
        assert not (await store.try_acquire(key, retry, LOCK_TTL)).acquired


async def test_renewing_a_checkpointed_lease_keeps_its_checkpoints(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """A renewal touches the lease only, so it can never put back older checkpoints than the
    handler has saved since."""
    require_recovery(store)
    pending = await held(store, make_record)
    saved = checkpointed(pending, harness.now())
    assert await store.save_progress("k1", saved, RETENTION_TTL, 0)
    before = await store.get("k1")
    assert before is not None

    assert await store.renew("k1", "owner-a", LOCK_TTL)

    after = await store.get("k1")
    assert_same_but_lease(after, saved)
    assert after is not None
    assert after.locked_until is not None
    assert before.locked_until is not None
    assert after.locked_until > before.locked_until
    taken = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert not taken.acquired
    assert taken.lease_expired is False


async def checkpointed_briefly(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord, key: str, lease: float
) -> IdempotencyRecord:
    """``owner-a``'s record for ``key`` with a recovery point, kept ``SHORT_TTL`` (the end of
    its retention) with a lease of ``lease``."""
    record = make_record(key, "owner-a")
    assert (await store.try_acquire(key, record, LOCK_TTL)).acquired
    saved = checkpointed(record, harness.now())
    assert await store.save_progress(key, saved, SHORT_TTL, lease)
    return saved


async def test_a_recovery_near_the_end_of_the_retention_keeps_the_record_for_its_lease(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """The handler died after its recovery point; a retry recovers the key as the retention
    counted from that point is about to end. The record lives on while the recovered handler's
    lease runs: gone, a further retry would run the handler afresh beside it, without the
    recovery points."""
    require_recovery(store)
    await checkpointed_briefly(harness, store, make_record, "k1", 0)
    await checkpointed_briefly(harness, store, make_record, "control", 0)  # kept past k1's end

    recovered = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert recovered.acquired
    await harness.expire("control", SHORT_TTL)  # k1's retention has ended too

    stored = await assert_held_by(store, make_record, "owner-b")
    assert [point.name for point in stored.checkpoints] == ["provider_charge_sent"]


async def assert_held_by(
    store: IdempotencyStore, make_record: MakeRecord, owner: str
) -> IdempotencyRecord:
    """``k1`` is still there, held by ``owner``'s running lease: another request gets it held,
    its owner renews it. Returns it as stored."""
    stored = await store.get("k1")
    assert stored is not None, "the record went while its handler's lease ran"
    assert stored.owner_token == owner
    busy = await store.try_acquire("k1", make_record("k1", "owner-c"), LOCK_TTL)
    assert not busy.acquired
    assert busy.lease_expired is False
    assert await store.renew("k1", owner, LOCK_TTL)
    return stored


async def test_a_renewed_lease_keeps_its_record_past_the_retention(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """A renewal that takes a checkpointed record's lease past the end of its retention keeps
    the record until the lease's end: the handler still runs and holds it."""
    require_recovery(store)
    await checkpointed_briefly(harness, store, make_record, "k1", SHORT_TTL)
    await checkpointed_briefly(harness, store, make_record, "control", SHORT_TTL)

    assert await store.renew("k1", "owner-a", LOCK_TTL)
    await harness.expire("control", SHORT_TTL)  # k1's retention has ended too

    await assert_held_by(store, make_record, "owner-a")


async def test_a_renewal_keeps_a_checkpointed_record_for_the_retention_it_is_given(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """``renew(..., ttl=)``: the record is kept ``ttl`` from the renewal, on the store's clock,
    past the end of its lease and of the retention counted from its recovery point; should its
    handler die, a retry of the same request still recovers it."""
    require_recovery(store)
    renew: Callable[..., Awaitable[bool]] = store.renew  # the protocol's optional ttl
    await checkpointed_briefly(harness, store, make_record, "k1", SHORT_TTL)

    assert await renew("k1", "owner-a", SHORT_TTL / 6, ttl=RETENTION_TTL)
    await checkpointed_briefly(harness, store, make_record, "control", SHORT_TTL)
    await harness.expire("control", SHORT_TTL)  # k1's lease and first retention have ended

    stored = await store.get("k1")
    assert stored is not None, "the record went before the retention its renewal gave it"
    assert stored.owner_token == "owner-a"
    recovered = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert recovered.acquired
    assert recovered.record is not None
    assert [point.name for point in recovered.record.checkpoints] == ["provider_charge_sent"]


async def test_a_renewal_never_shortens_a_checkpointed_records_retention(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """A ``ttl`` shorter than what is left of the retention leaves it as it is."""
    require_recovery(store)
    renew: Callable[..., Awaitable[bool]] = store.renew  # the protocol's optional ttl
    pending = await held(store, make_record)
    assert await store.save_progress("k1", checkpointed(pending, harness.now()), 3600, 0)
    await checkpointed_briefly(harness, store, make_record, "control", SHORT_TTL)

    assert await renew("k1", "owner-a", SHORT_TTL / 6, ttl=SHORT_TTL / 6)
    await harness.expire("control", SHORT_TTL)

    assert await store.get("k1") is not None, "a renewal brought the record's expiry forward"


def pending_at(record: IdempotencyRecord, now: float) -> IdempotencyRecord:
    """``record`` as a pod whose clock reads ``now`` makes it."""
    return replace(record, created_at=now, expires_at=now + LOCK_TTL)


def resolving(store: IdempotencyStore) -> StoreBase:
    """``store``, which resolves records as :class:`StoreBase` does (else the test skips)."""
    if not isinstance(store, StoreBase):
        pytest.skip(f"{type(store).__name__} is not a StoreBase: it has no resolve()")
    return store


RESOLVED = StoredResponse(201, (("content-type", "application/json"),), b'{"by":"operator"}')


async def test_a_resolution_outlasts_the_handler_it_replaced(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """The handler's lease ran out after a recovery point (it froze); an operator resolves the
    key. The handler wakes: its response no longer replaces the operator's, which every
    retry has been answered with since."""
    require_recovery(store)
    frozen = checkpointed(await held(store, make_record), harness.now())
    assert await store.save_progress("k1", frozen, RETENTION_TTL, 0)

    assert await resolving(store).resolve("k1", RESOLVED, owner_token="owner-a")

    assert not await store.finish("k1", finished(frozen), RETENTION_TTL)
    assert not await store.renew("k1", "owner-a", LOCK_TTL)
    stored = await store.get("k1")
    assert stored is not None
    assert stored.response == RESOLVED
    assert [point.name for point in stored.checkpoints] == ["provider_charge_sent"]


async def test_a_resolution_leaves_a_record_that_changed_hands(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """The operator looked at ``owner-a``'s record; a retry (``owner-b``) recovered it since
    and runs: ``resolve`` with the token the operator saw leaves it to that retry."""
    require_recovery(store)
    first = await held(store, make_record)
    assert await store.save_progress("k1", checkpointed(first, harness.now()), RETENTION_TTL, 0)
    assert (await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)).acquired

    assert not await resolving(store).resolve("k1", RESOLVED, owner_token="owner-a")

    stored = await store.get("k1")
    assert stored is not None
    assert stored.status is RecordStatus.IN_PROGRESS
    assert stored.owner_token == "owner-b"


async def test_a_resolution_leaves_a_record_whose_handler_holds_it_again(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """The operator saw the lease run out (on a clock of its own, or before the handler woke
    and renewed it): on the store's clock it runs, so the handler may still answer."""
    require_recovery(store)
    running = checkpointed(await held(store, make_record), harness.now())
    assert await store.save_progress("k1", running, RETENTION_TTL, LOCK_TTL)

    assert not await resolving(store).resolve("k1", RESOLVED, owner_token="owner-a")

    stored = await store.get("k1")
    assert stored is not None
    assert stored.status is RecordStatus.IN_PROGRESS
    assert await store.finish("k1", finished(running), RETENTION_TTL)


@pytest.mark.parametrize("status_code", [100, 101, 199])
async def test_resolve_refuses_a_status_no_replay_can_send(
    store: IdempotencyStore, make_record: MakeRecord, status_code: int
) -> None:
    await held(store, make_record)
    with pytest.raises(ValueError, match="a final response"):
        await resolving(store).resolve("k1", StoredResponse(status_code, (), b""))


async def test_a_resolution_given_an_http_status_member_is_stored(
    store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """A reconciler's ``StoredResponse(HTTPStatus.OK, ...)``: MemoryStore raised ``ValueError``
    (marshal takes no ``int`` subclass), and the record stayed ``InProgress``."""
    await held(store, make_record)
    assert await resolving(store).resolve("k1", StoredResponse(HTTPStatus.OK, (), b"{}"))
    stored = await store.get("k1")
    assert stored is not None
    assert stored.status is RecordStatus.COMPLETED
    assert stored.response is not None
    assert type(stored.response.status_code) is int
    assert stored.response.status_code == 200


def between_look_and_takeover(
    monkeypatch: pytest.MonkeyPatch,
    store: IdempotencyStore,
    meanwhile: Callable[[], Awaitable[None]],
) -> None:
    """Run ``meanwhile`` once, right after ``store``'s next ``get``: between what ``delete`` or
    ``resolve`` looked at and its takeover, deterministically."""
    look = store.get

    async def get(key: str) -> IdempotencyRecord | None:
        seen = await look(key)
        monkeypatch.setattr(store, "get", look)
        await meanwhile()
        return seen

    monkeypatch.setattr(store, "get", get)


async def lapsed_after_a_point(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> IdempotencyRecord:
    """``owner-a``'s record for ``k1`` with a recovery point, its lease ended (it died)."""
    saved = checkpointed(await held(store, make_record), harness.now())
    assert await store.save_progress("k1", saved, RETENTION_TTL, 0)
    return saved


async def recovered_and_died_again(
    harness: ClockedStore, store: IdempotencyStore, make_record: MakeRecord
) -> None:
    """A retry (``owner-b``) recovers ``k1``, saves a further point and dies too."""
    retry = await store.try_acquire("k1", make_record("k1", "owner-b"), LOCK_TTL)
    assert retry.acquired
    assert retry.record is not None
    point = Checkpoint("refund_sent", {"n": 2}, harness.now())
    again = replace(retry.record, owner_token="owner-b")
    again = replace(again, checkpoints=(*again.checkpoints, point))
    assert await store.save_progress("k1", again, RETENTION_TTL, 0)


async def by_owner(store: StoreBase, operation: str, owner_token: str | None) -> bool:
    if operation == "delete":
        return await store.delete("k1", owner_token=owner_token)
    return await store.resolve("k1", RESOLVED, owner_token=owner_token)


@pytest.mark.parametrize("operation", ["delete", "resolve"])
async def test_an_operator_leaves_a_lapsed_record_that_changed_hands_meanwhile(
    harness: ClockedStore,
    store: IdempotencyStore,
    make_record: MakeRecord,
    monkeypatch: pytest.MonkeyPatch,
    operation: str,
) -> None:
    """The operator looked at ``owner-a``'s lapsed record; before its takeover, a retry
    (``owner-b``) recovered it, saved a further point and died too, its lease ended. With the
    token the operator saw, the takeover of ``owner-b``'s record is given back: lapsed, for the
    next retry to recover with both points."""
    require_recovery(store)
    operator = resolving(store)
    await lapsed_after_a_point(harness, store, make_record)
    between_look_and_takeover(
        monkeypatch, store, lambda: recovered_and_died_again(harness, store, make_record)
    )

    assert not await by_owner(operator, operation, "owner-a")

    stored = await store.get("k1")
    assert stored is not None, f"{operation} deleted a record that changed hands"
    assert stored.status is RecordStatus.IN_PROGRESS
    assert stored.response is None
    retry = await store.try_acquire("k1", make_record("k1", "owner-c"), LOCK_TTL)
    assert retry.acquired, "the record was not left lapsed for a retry to recover"
    assert retry.record is not None
    assert [point.name for point in retry.record.checkpoints] == [
        "provider_charge_sent",
        "refund_sent",
    ]


@pytest.mark.parametrize("operation", ["delete", "resolve"])
async def test_an_operator_leaves_a_key_whose_record_went_meanwhile(
    harness: ClockedStore,
    store: IdempotencyStore,
    make_record: MakeRecord,
    monkeypatch: pytest.MonkeyPatch,
    operation: str,
) -> None:
    """The record looked at went before the takeover: there is nothing of that owner's to
    act on, and the key is left free (not held by the takeover), nothing resolved into it."""
    require_recovery(store)
    operator = resolving(store)
    await lapsed_after_a_point(harness, store, make_record)

    async def gone() -> None:
        assert await store.release("k1", "owner-a")

    between_look_and_takeover(monkeypatch, store, gone)

    assert not await by_owner(operator, operation, "owner-a")

    assert await store.get("k1") is None
    fresh = await store.try_acquire("k1", make_record("k1", "owner-c"), LOCK_TTL)
    assert fresh.acquired
    assert fresh.record is None or not fresh.record.checkpoints


async def test_a_resolution_keeps_the_points_saved_since_it_looked(
    harness: ClockedStore,
    store: IdempotencyStore,
    make_record: MakeRecord,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``owner-a`` woke, saved a further point and died again, after the operator looked: the
    resolved record keeps the points its row has, not those the operator saw."""
    require_recovery(store)
    operator = resolving(store)
    saved = await lapsed_after_a_point(harness, store, make_record)

    async def one_more_point() -> None:
        point = Checkpoint("refund_sent", {"n": 2}, harness.now())
        later = replace(saved, checkpoints=(*saved.checkpoints, point))
        assert await store.save_progress("k1", later, RETENTION_TTL, 0)

    between_look_and_takeover(monkeypatch, store, one_more_point)

    assert await operator.resolve("k1", RESOLVED, owner_token="owner-a")

    stored = await store.get("k1")
    assert stored is not None
    assert stored.response == RESOLVED
    assert [point.name for point in stored.checkpoints] == ["provider_charge_sent", "refund_sent"]


async def test_a_forced_resolution_finishes_the_record_that_is_there(
    harness: ClockedStore,
    store: IdempotencyStore,
    make_record: MakeRecord,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an owner token (``--force``), the record that changed hands meanwhile is
    resolved: with its own recovery points, the retry's among them."""
    require_recovery(store)
    operator = resolving(store)
    await lapsed_after_a_point(harness, store, make_record)
    between_look_and_takeover(
        monkeypatch, store, lambda: recovered_and_died_again(harness, store, make_record)
    )

    assert await operator.resolve("k1", RESOLVED)

    stored = await store.get("k1")
    assert stored is not None
    assert stored.response == RESOLVED
    assert [point.name for point in stored.checkpoints] == ["provider_charge_sent", "refund_sent"]
