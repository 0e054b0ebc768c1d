"""Many acquires of one key at the same moment: exactly one wins, every round.

Each contender holds its own database connection, released together by a barrier, for a fresh
key (the INSERT race) and for an expired row (the takeover race).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
import uuid
from multiprocessing.synchronize import Barrier
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency._record import IdempotencyRecord, RecordStatus, StoredResponse
from starlette_idempotency.stores.base import AcquireResult
from starlette_idempotency.stores.postgres import PostgresStore

pytestmark = pytest.mark.postgres

TASKS = 20
TASK_ROUNDS = 50
PROCESSES = 4
PROCESS_ROUNDS = 10
LOCK_TTL = 30.0
BARRIER_TIMEOUT = 60.0


def pending(owner: str) -> IdempotencyRecord:
    now = time.time()
    return IdempotencyRecord(
        key="race",
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint="fp",
        owner_token=owner,
        created_at=now,
        expires_at=now + LOCK_TTL,
    )


async def plant_expired_row(dsn: str, table: str, key: str, *, finished: bool = False) -> None:
    """A row under ``key`` whose lock has lapsed, or (``finished``) whose retention has ended,
    for the takeover race."""
    store = await PostgresStore.connect(dsn, table=table, max_size=1)
    try:
        crashed = pending("crashed-owner")
        assert (await store.try_acquire(key, crashed, LOCK_TTL)).acquired
        if finished:
            answer = StoredResponse(201, (), b"{}", "application/json")
            done = crashed.finished(RecordStatus.COMPLETED, answer, time.time() + LOCK_TTL)
            assert await store.finish(key, done, LOCK_TTL)
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(
                f"UPDATE {table} SET expires_at = now() - interval '1 second' WHERE key = $1",
                f"idempotency:{key}",
            )
        finally:
            await connection.close()
    finally:
        await store.aclose()


def check_round(results: dict[str, AcquireResult], takeover: bool) -> None:
    winners = [owner for owner, result in results.items() if result.acquired]
    assert len(winners) == 1, f"winners: {winners}"
    winner = winners[0]
    if takeover:
        taken = results[winner].record
        assert taken is not None
        assert taken.owner_token == "crashed-owner"
    for owner, result in results.items():
        if owner != winner:
            assert result.record is not None
            assert result.record.owner_token == winner  # every loser sees the winner's lock


async def contend(
    store: PostgresStore, owner: str, key: str, barrier: asyncio.Barrier
) -> tuple[str, AcquireResult]:
    await store.get("warm-up")  # the connection is open before the barrier
    await barrier.wait()
    return owner, await store.try_acquire(key, pending(owner), LOCK_TTL)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
async def test_concurrent_tasks_each_with_own_connection(
    postgres_dsn: str, postgres_table: str, isolation: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever isolation the database runs transactions at by default, the store's statements
    run at the one they are written for: no contender fails with a serialization error (the
    middleware's 503) where it should have lost the race (409)."""
    default = {"default_transaction_isolation": isolation}
    stores = [
        await PostgresStore.connect(
            postgres_dsn, table=postgres_table, min_size=1, max_size=1, server_settings=default
        )
        for _ in range(TASKS)
    ]
    try:
        await stores[0].create_schema()
        for round_number in range(TASK_ROUNDS):
            key = f"task-round-{round_number}"
            takeover = round_number % 2 == 1
            if takeover:
                # Losers skip the row the winner has locked, then see the winner's: never the
                # expired record, whose answer they would have replayed, or judged 422 by.
                finished = round_number % 4 == 3
                await plant_expired_row(postgres_dsn, postgres_table, key, finished=finished)
            barrier = asyncio.Barrier(TASKS)
            results = await asyncio.gather(
                *(contend(store, f"task-{n}", key, barrier) for n, store in enumerate(stores))
            )
            check_round(dict(results), takeover)
        explicit = [r for r in caplog.records if "explicit READ COMMITTED" in r.getMessage()]
        assert len(explicit) == (0 if isolation == "read committed" else TASKS)  # one per store
    finally:
        for store in stores:
            await store.aclose()


def _contender(
    dsn: str, table: str, owner: str, barrier: Barrier, results: Any, rounds: int
) -> None:
    """A separate OS process: one store, one connection, one acquire per round."""

    async def run() -> None:
        store = await PostgresStore.connect(dsn, table=table, min_size=1, max_size=1)
        try:
            await store.get("warm-up")
            for round_number in range(rounds):
                barrier.wait(BARRIER_TIMEOUT)  # the round is prepared
                result = await store.try_acquire(
                    f"process-round-{round_number}", pending(owner), LOCK_TTL
                )
                results.put((round_number, owner, result))
                barrier.wait(BARRIER_TIMEOUT)  # everyone has answered
        finally:
            await store.aclose()

    asyncio.run(run())


def test_concurrent_processes(postgres_dsn: str, postgres_table: str) -> None:
    async def create_schema() -> None:
        store = await PostgresStore.connect(postgres_dsn, table=postgres_table, max_size=1)
        await store.create_schema()
        await store.aclose()

    asyncio.run(create_schema())
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES + 1)
    results = context.Queue()
    owners = [f"process-{n}-{uuid.uuid4().hex[:6]}" for n in range(PROCESSES)]
    processes = [
        context.Process(
            target=_contender,
            args=(postgres_dsn, postgres_table, owner, barrier, results, PROCESS_ROUNDS),
            daemon=True,
        )
        for owner in owners
    ]
    for process in processes:
        process.start()
    try:
        for round_number in range(PROCESS_ROUNDS):
            takeover = round_number % 2 == 1
            if takeover:
                key = f"process-round-{round_number}"
                asyncio.run(plant_expired_row(postgres_dsn, postgres_table, key))
            barrier.wait(BARRIER_TIMEOUT)
            barrier.wait(BARRIER_TIMEOUT)
            answers = [results.get(timeout=BARRIER_TIMEOUT) for _ in owners]
            assert {answer[0] for answer in answers} == {round_number}
            check_round({owner: result for _, owner, result in answers}, takeover)
        for process in processes:
            process.join(BARRIER_TIMEOUT)
            assert process.exitcode == 0
    finally:
        barrier.abort()
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
