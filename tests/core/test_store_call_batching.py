"""Store calls made while others wait on the store go out after the loop's ready work, so that
the calls of requests ready together reach the store's server together; a call made alone goes
out at once, and so does every call to a store that sends a turn's calls together itself
(BoundedStore)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency._store_calls import BoundedStore
from tests.core.test_deadlines import Stalling, bounded


def recording(order: list[str], entry: str) -> Callable[[], Awaitable[None]]:
    async def record() -> None:
        order.append(entry)

    return record


class Batching(Stalling):
    """A store that says it sends a turn's calls together itself."""

    batches_calls = True


@asynccontextmanager
async def another_call_waiting(
    store: Stalling | None = None,
) -> AsyncIterator[tuple[BoundedStore, Stalling, asyncio.Future[IdempotencyRecord | None]]]:
    """A bounded ``store`` with a call on key ``"waiting"`` in flight until the block ends."""
    if store is None:
        calls, store = bounded(5.0)
    else:
        calls = BoundedStore(store, timeout=5.0, metrics=None, tracer=None)
    answer = asyncio.Event()
    entered = asyncio.Event()

    async def stall() -> None:
        entered.set()
        await answer.wait()

    store.stalls["waiting"] = stall
    waiting = asyncio.ensure_future(calls.get("waiting"))
    await entered.wait()
    try:
        yield calls, store, waiting
    finally:
        answer.set()
        await waiting


async def test_a_call_made_alone_goes_out_at_once() -> None:
    calls, store = bounded(5.0)
    order: list[str] = []
    store.stalls["k"] = recording(order, "store")
    asyncio.get_running_loop().call_soon(order.append, "ready work")
    await calls.get("k")
    assert order == ["store"]  # before the ready work ran


async def test_a_call_made_while_another_waits_goes_out_after_the_ready_work() -> None:
    order: list[str] = []
    async with another_call_waiting() as (calls, store, _):
        store.stalls["k"] = recording(order, "store")
        asyncio.get_running_loop().call_soon(order.append, "ready work")
        await calls.get("k")
    assert order == ["ready work", "store"]


async def test_a_call_to_a_store_that_batches_goes_out_at_once_while_another_waits() -> None:
    order: list[str] = []
    async with another_call_waiting(Batching()) as (calls, store, _):
        store.stalls["k"] = recording(order, "store")
        asyncio.get_running_loop().call_soon(order.append, "ready work")
        await calls.get("k")
    assert order == ["store", "ready work"]


async def test_calls_of_requests_ready_together_reach_the_store_together() -> None:
    order: list[str] = []
    async with another_call_waiting() as (calls, store, _):

        async def request(number: int) -> None:
            order.append(f"work {number}")  # what a request does before its store call
            await calls.get(str(number))

        for number in range(4):
            store.stalls[str(number)] = recording(order, f"call {number}")
        await asyncio.gather(*(request(number) for number in range(4)))
    assert order == [*(f"work {n}" for n in range(4)), *(f"call {n}" for n in range(4))]


async def test_a_call_cancelled_before_it_went_out_never_reaches_the_store() -> None:
    order: list[str] = []
    async with another_call_waiting() as (calls, store, waiting):
        store.stalls["k"] = recording(order, "store")
        task = asyncio.ensure_future(calls.get("k"))
        await asyncio.sleep(0)  # the call has begun, and waits for the loop's ready work
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        loop = asyncio.get_running_loop()
        assert set(calls._in_flight.get(loop).due) == {waiting}
    assert order == []
