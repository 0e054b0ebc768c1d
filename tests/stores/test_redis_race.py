"""Exactly one winner when many clients race for one key: separate connections, then processes."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.queues
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from multiprocessing.synchronize import Barrier

import pytest
import redis.asyncio as aioredis

from starlette_idempotency._record import Checkpoint
from starlette_idempotency.stores.base import AcquireResult
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.testing._isolation import delete_prefixed, unique_prefix
from tests.support.records import pending
from tests.support.stores import DRIVERS, STRATEGIES

pytestmark = pytest.mark.redis

CLIENTS = 20
ROUNDS = 50
PROCESSES = 4
PROCESS_ROUNDS = 10
TAKEOVER_ROUNDS = 20
LOCK_TTL = 30.0


@contextlib.asynccontextmanager
async def independent_stores(
    url: str, prefix: str, acquire: AcquireStrategy, driver: DriverName
) -> AsyncIterator[list[RedisStore]]:
    """CLIENTS stores, each with a client (and so connections) of its own, already connected
    (scripts loaded), so the rounds race on open connections."""
    stores = [
        RedisStore.from_url(url, key_prefix=prefix, acquire=acquire, driver=driver)
        for _ in range(CLIENTS)
    ]
    try:
        await asyncio.gather(*(store.get("warm-up") for store in stores))
        yield stores
    finally:
        await asyncio.gather(*(store.aclose() for store in stores))


async def race(stores: list[RedisStore], key: str, round_number: int) -> list[AcquireResult]:
    """Every store tries to acquire ``key`` at once (store i as owner-i); exactly one wins, and
    every loser sees the winner's record. Returns the results, the winner's first."""
    results = await asyncio.gather(
        *(
            store.try_acquire(key, pending(key, f"owner-{i}"), LOCK_TTL)
            for i, store in enumerate(stores)
        )
    )
    winners = [i for i, result in enumerate(results) if result.acquired]
    assert len(winners) == 1, f"round {round_number}: winners {winners}"
    losers = [result for result in results if not result.acquired]
    for result in losers:
        assert result.record is not None
        assert result.record.owner_token == f"owner-{winners[0]}"
    return [results[winners[0]], *losers]


@STRATEGIES
@DRIVERS
async def test_one_winner_among_independent_connections(
    redis_url: str, redis_key_prefix: str, acquire: AcquireStrategy, driver: DriverName
) -> None:
    async with independent_stores(redis_url, redis_key_prefix, acquire, driver) as stores:
        for round_number in range(ROUNDS):
            key = f"round-{round_number}"
            _, loser, *_ = await race(stores, key, round_number)
            stored = await stores[0].get(key)
            assert stored is not None
            assert loser.record is not None
            assert stored.owner_token == loser.record.owner_token


@STRATEGIES
@DRIVERS
async def test_one_winner_takes_over_a_dead_handlers_checkpoints(
    redis_url: str, redis_key_prefix: str, acquire: AcquireStrategy, driver: DriverName
) -> None:
    async with independent_stores(redis_url, redis_key_prefix, acquire, driver) as stores:
        for round_number in range(TAKEOVER_ROUNDS):
            key = f"takeover-{round_number}"
            dead = pending(key, "dead-owner")
            assert (await stores[0].try_acquire(key, dead, LOCK_TTL)).acquired
            point = Checkpoint("sent", {"n": round_number}, time.time())
            saved = replace(dead, checkpoints=(point,))
            assert await stores[0].save_progress(key, saved, 60, 0)  # its lease ends now
            winner, *losers = await race(stores, key, round_number)
            taken = winner.record
            assert taken is not None
            assert taken.owner_token == "dead-owner"
            for result in losers:
                assert result.record is not None
                assert result.record.checkpoints == taken.checkpoints


def _contend(
    url: str,
    prefix: str,
    acquire: AcquireStrategy,
    worker: int,
    barrier: Barrier,
    results: multiprocessing.queues.Queue[tuple[int, int, bool, str | None]],
) -> None:
    """One process: per round, wait at the barrier, then try to acquire the round's key."""

    async def run() -> None:
        store = RedisStore.from_url(url, key_prefix=prefix, acquire=acquire)
        try:
            await store.get("warm-up")
            for round_number in range(PROCESS_ROUNDS):
                key = f"round-{round_number}"
                record = pending(key, f"process-{worker}")
                barrier.wait(timeout=30)  # blocks this process's only task: nothing else to run
                result = await store.try_acquire(key, record, LOCK_TTL)
                holder = result.record.owner_token if result.record is not None else None
                results.put((round_number, worker, result.acquired, holder))
        finally:
            await store.aclose()

    asyncio.run(run())


@STRATEGIES
def test_one_winner_among_processes(redis_url: str, acquire: AcquireStrategy) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results: multiprocessing.queues.Queue[tuple[int, int, bool, str | None]] = context.Queue()
    prefix = unique_prefix()
    workers = [
        context.Process(target=_contend, args=(redis_url, prefix, acquire, i, barrier, results))
        for i in range(PROCESSES)
    ]
    for process in workers:
        process.start()
    try:
        outcomes: dict[int, list[tuple[int, bool, str | None]]] = {}
        for _ in range(PROCESSES * PROCESS_ROUNDS):
            try:
                round_number, worker, acquired, holder = results.get(timeout=60)
            except queue.Empty:
                pytest.fail(
                    f"workers stopped reporting; exit codes {[p.exitcode for p in workers]}"
                )
            outcomes.setdefault(round_number, []).append((worker, acquired, holder))
        for process in workers:
            process.join(timeout=30)
            assert process.exitcode == 0
    finally:
        for process in workers:
            if process.is_alive():
                process.kill()
                process.join()
        asyncio.run(_cleanup(redis_url, prefix))

    assert sorted(outcomes) == list(range(PROCESS_ROUNDS))
    for round_number, entries in outcomes.items():
        winners = [worker for worker, acquired, _ in entries if acquired]
        assert len(winners) == 1, f"round {round_number}: winners {winners}"
        assert {holder for _, acquired, holder in entries if not acquired} == {
            f"process-{winners[0]}"
        }


async def _cleanup(url: str, prefix: str) -> None:
    client = aioredis.from_url(url)
    try:
        await delete_prefixed(client, prefix)
    finally:
        await client.aclose()
