"""What PostgresStore's fenced writes report (FencedWrite), and acquires of the owner's own key.

``complete`` and ``fail`` say WRITTEN when the owner's live row was replaced, RECLAIMED when the
key was free (absent, or its row expired) and written anyway, LOST when another owner holds it.
The races at the end run the owner's write against competing acquires, its own renewal and a
purge, on separate connections, over many rounds, and check that the answers and the rows agree.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import replace
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency._record import Checkpoint, RecordStatus, record_to_dict
from starlette_idempotency.stores._postgres_sql import row_params
from starlette_idempotency.stores.base import AcquireResult, FencedWrite
from starlette_idempotency.stores.postgres import PostgresStore
from tests.support.postgres import (
    LOCK_TTL,
    TTL,
    completed,
    expire,
    lapsed_lock,
    lock_waiter,
    pending,
)

pytestmark = pytest.mark.postgres

ROUNDS = 80
COMPETITORS = 3


async def test_owner_holding_its_live_row_writes(postgres_store: PostgresStore) -> None:
    record = pending("owner-1")
    await postgres_store.try_acquire("k", record, LOCK_TTL)
    assert await postgres_store.finish("k", completed(record), TTL) is FencedWrite.WRITTEN
    # Sent again (a reply lost on the way): the owner's row is still live, so WRITTEN again.
    assert await postgres_store.finish("k", completed(record), TTL) is FencedWrite.WRITTEN

    other = pending("owner-2", key="k2")
    await postgres_store.try_acquire("k2", other, LOCK_TTL)
    assert await postgres_store.finish("k2", completed(other), TTL) is FencedWrite.WRITTEN


async def test_free_key_is_reclaimed(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    never_held = pending("owner-1")
    assert (
        await postgres_store.finish("absent", completed(never_held), TTL) is FencedWrite.RECLAIMED
    )

    released = pending("owner-2")
    await postgres_store.try_acquire("released", released, LOCK_TTL)
    assert await postgres_store.release("released", "owner-2")
    assert (
        await postgres_store.finish("released", completed(released), TTL) is FencedWrite.RECLAIMED
    )

    lapsed = pending("owner-3")  # its own lock lapsed and nobody took the key
    await lapsed_lock(postgres_store, sql, postgres_table, "lapsed", lapsed)
    assert await postgres_store.finish("lapsed", completed(lapsed), TTL) is FencedWrite.RECLAIMED

    taken = pending("owner-4")  # another owner's expired row
    await lapsed_lock(postgres_store, sql, postgres_table, "taken", pending("owner-5"))
    assert await postgres_store.finish("taken", completed(taken), TTL) is FencedWrite.RECLAIMED

    for key, owner in [("absent", "owner-1"), ("released", "owner-2"), ("lapsed", "owner-3")]:
        stored = await postgres_store.get(key)
        assert stored is not None
        assert (stored.owner_token, stored.status) == (owner, RecordStatus.COMPLETED)


async def test_another_owners_live_row_is_lost_and_untouched(
    postgres_store: PostgresStore,
) -> None:
    holder = pending("holder")
    await postgres_store.try_acquire("k", holder, LOCK_TTL)
    late = pending("late")
    assert await postgres_store.finish("k", completed(late), TTL) is FencedWrite.LOST
    assert not await postgres_store.finish("k", completed(late), TTL)
    stored = await postgres_store.get("k")
    assert stored is not None
    assert record_to_dict(stored) == record_to_dict(holder)


async def test_acquire_finding_its_own_live_row_is_acquired(postgres_store: PostgresStore) -> None:
    record = pending("owner-1")
    assert (await postgres_store.try_acquire("k", record, LOCK_TTL)).acquired
    for recover in (True, False):
        again = await postgres_store.try_acquire("k", record, LOCK_TTL, recover=recover)
        assert again == AcquireResult(acquired=True, record=None)
    stored = await postgres_store.get("k")
    assert stored is not None
    assert record_to_dict(stored) == record_to_dict(record)  # read, not rewritten

    # Someone else's acquire still finds the key held, by the same owner.
    held = await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)
    assert not held.acquired
    assert held.record is not None
    assert held.record.owner_token == "owner-1"


async def test_own_row_with_checkpoints_comes_back_with_them(
    postgres_store: PostgresStore,
) -> None:
    record = pending("owner-1")
    await postgres_store.try_acquire("k", record, LOCK_TTL)
    saved = replace(record, checkpoints=(Checkpoint("charged", {"id": 7}, at=1.0),))
    assert await postgres_store.save_progress("k", saved, TTL, LOCK_TTL)

    again = await postgres_store.try_acquire("k", record, LOCK_TTL, recover=False)
    assert again.acquired
    assert again.record is not None
    assert again.record.checkpoints == saved.checkpoints
    assert again.record.owner_token == "owner-1"


async def test_own_expired_row_is_taken_back_without_a_taken_over_record(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    record = pending("owner-1")
    await lapsed_lock(postgres_store, sql, postgres_table, "k", record)
    again = await postgres_store.try_acquire("k", record, LOCK_TTL, recover=False)
    assert again == AcquireResult(acquired=True, record=None)
    assert await postgres_store.renew("k", "owner-1", LOCK_TTL)  # the lock is live again


@pytest.mark.parametrize(
    ("start", "change", "expected"),
    [
        # The owner's renewal got there first: the owner held a live lock when it wrote.
        ("expired", "UPDATE {table} SET expires_at = now() + interval '1 minute'", "WRITTEN"),
        # Deleted (purged, or by an operator): the key was free for a while.
        ("live", "DELETE FROM {table}", "RECLAIMED"),
        ("live", "UPDATE {table} SET owner_token = 'other'", "LOST"),
    ],
    ids=["renewed", "deleted", "taken"],
)
async def test_the_row_as_it_is_when_written_decides_not_as_it_was(
    start: str,
    change: str,
    expected: str,
    postgres_dsn: str,
    postgres_table: str,
    application_name: str,
    sql: Any,
) -> None:
    """The row changes after the write's statement began (its snapshot shows the old row),
    while the write waits for the row's lock: the answer follows the row it finally writes."""
    store = await PostgresStore.connect(
        postgres_dsn,
        table=postgres_table,
        max_size=1,
        server_settings={"application_name": application_name},
    )
    watcher = await asyncpg.connect(postgres_dsn)
    try:
        await store.create_schema()
        record = pending("owner")
        await store.try_acquire("k", record, LOCK_TTL)
        if start == "expired":
            await expire(sql, postgres_table, "k")
        async with sql.transaction():
            await sql.execute(change.format(table=postgres_table) + " WHERE key = 'idempotency:k'")
            writing = asyncio.create_task(store.finish("k", completed(record), TTL))
            await lock_waiter(watcher, application_name)
        assert await writing is FencedWrite[expected]
    finally:
        await watcher.close()
        await store.aclose()


# --- races ---------------------------------------------------------------------------------


@pytest.fixture
async def stores(postgres_dsn: str, postgres_table: str) -> AsyncIterator[list[PostgresStore]]:
    """One store per contender, each on a single connection of its own."""
    opened = [
        await PostgresStore.connect(postgres_dsn, table=postgres_table, min_size=1, max_size=1)
        for _ in range(COMPETITORS + 3)
    ]
    try:
        await opened[0].create_schema()
        yield opened
    finally:
        for store in opened:
            await store.aclose()


async def arrange(kind: str, store: PostgresStore, sql: Any, table: str, key: str) -> None:
    """The owner's row before the race: live, expired, absent, or expiring right now."""
    assert (await store.try_acquire(key, pending("owner", key=key), LOCK_TTL)).acquired
    storage_key = f"idempotency:{key}"
    if kind == "expired":
        await expire(sql, table, key)
    elif kind == "absent":
        await sql.execute(f"DELETE FROM {table} WHERE key = $1", storage_key)
    elif kind == "expiring":
        # Within a few milliseconds of the race, so statements disagree on whether it is live.
        await sql.execute(
            f"UPDATE {table} SET expires_at = now() + make_interval(secs => $2) WHERE key = $1",
            storage_key,
            random.uniform(0.0, 0.01),
        )


async def started_together(barrier: asyncio.Barrier, operation: Awaitable[Any]) -> Any:
    await barrier.wait()
    return await operation


async def test_fenced_write_agrees_with_the_row_under_concurrent_writers(
    stores: list[PostgresStore], postgres_table: str, sql: Any
) -> None:
    owner_store, renewer, purger, *competitors = stores
    for store in stores:
        await store.get("warm-up")  # each connection is open before the first barrier
    kinds = ["live", "expired", "absent", "expiring"]
    for round_number in range(ROUNDS):
        kind, key = kinds[round_number % len(kinds)], f"round-{round_number}"
        await arrange(kind, owner_store, sql, postgres_table, key)
        final = completed(pending("owner", key=key))
        # Coroutines start only when awaited: all of them after the barrier.
        operations: list[Coroutine[Any, Any, Any]] = [
            owner_store.finish(key, final, TTL),
            renewer.renew(key, "owner", LOCK_TTL),
            purger.purge_expired(),
            *(
                store.try_acquire(key, pending(f"competitor-{n}", key=key), LOCK_TTL)
                for n, store in enumerate(competitors)
            ),
        ]
        barrier = asyncio.Barrier(len(operations))
        written, renewed, purged, *acquires = await asyncio.gather(
            *(started_together(barrier, operation) for operation in operations)
        )

        winners = [n for n, result in enumerate(acquires) if result.acquired]
        stored = await owner_store.get(key)
        assert stored is not None
        if written is FencedWrite.LOST:
            assert len(winners) == 1, (kind, winners)
            assert stored.owner_token == f"competitor-{winners[0]}"
            assert stored.status is RecordStatus.IN_PROGRESS
        else:
            assert winners == [], (kind, written)  # the key was never free for a competitor
            assert record_to_dict(stored) == record_to_dict(final)
        if kind == "live" or renewed:
            assert written is FencedWrite.WRITTEN  # nobody may take a live lock
        if purged:
            assert written is not FencedWrite.WRITTEN  # the row was gone for a while
        if kind in ("expired", "absent"):
            assert written is not FencedWrite.WRITTEN  # the owner did not hold the key
        for result in acquires:
            if not result.acquired:
                # It saw the final holder, or (before its lock was taken) the first one.
                assert result.record is not None
                assert result.record.owner_token in (stored.owner_token, "owner")


# -- undoing an abandoned acquire ---------------------------------------------------------------


async def abandon(store: PostgresStore, key: str, record: Any) -> bool:
    """The statement that undoes ``record``'s abandoned acquire of ``key``."""
    params = row_params(f"idempotency:{key}", record, LOCK_TTL)
    return bool(await store._fetchval("undo (abandon)", "abandon", *params))


async def test_undoing_an_abandoned_acquire_frees_the_key(postgres_store: PostgresStore) -> None:
    mine = pending("owner-1")
    assert (await postgres_store.try_acquire("k", mine, LOCK_TTL)).acquired

    assert await abandon(postgres_store, "k", mine)

    assert await postgres_store.get("k") is None
    assert (await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired


async def test_an_insert_landing_after_its_undo_writes_nothing(
    postgres_store: PostgresStore,
) -> None:
    """The undo can run before the abandoned INSERT reaches the table (a connection that
    stalled): it leaves an expired row under the abandoned token that the INSERT meets."""
    late = pending("owner-1")
    assert not await abandon(postgres_store, "k", late)

    assert (
        await postgres_store._fetchval(
            "try_acquire", "acquire_insert", *row_params("idempotency:k", late, 30)
        )
        is None
    )  # the late INSERT: nothing written
    assert await postgres_store.get("k") is None
    assert (await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired


async def test_undoing_an_abandoned_recovery_keeps_the_checkpoints(
    postgres_store: PostgresStore,
) -> None:
    dead = pending("owner-1")
    await postgres_store.try_acquire("k", dead, LOCK_TTL)
    saved = replace(dead, checkpoints=(Checkpoint("charged", {"id": 7}, at=1.0),))
    assert await postgres_store.save_progress("k", saved, TTL, 0)
    taking = pending("owner-2")
    assert (await postgres_store.try_acquire("k", taking, LOCK_TTL)).acquired

    assert await abandon(postgres_store, "k", taking)

    retry = await postgres_store.try_acquire("k", pending("owner-3"), LOCK_TTL)
    assert retry.acquired  # the lease ended at once
    assert retry.record is not None
    assert retry.record.checkpoints == saved.checkpoints


async def test_an_undo_leaves_another_owners_row_alone(postgres_store: PostgresStore) -> None:
    holder = pending("owner-2")
    assert (await postgres_store.try_acquire("k", holder, LOCK_TTL)).acquired

    assert not await abandon(postgres_store, "k", pending("owner-1"))

    found = await postgres_store.get("k")
    assert found is not None
    assert found.owner_token == "owner-2"
