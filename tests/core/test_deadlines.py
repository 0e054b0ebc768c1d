"""Store-call deadlines: a call's task enters the loop's calls in flight and leaves them, and
one timer per event loop cancels a late call (BoundedStore, CallsInFlight)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from starlette_idempotency import MemoryStore
from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency.errors import StoreTimeoutError
from tests.support.conditions import eventually


class Stalling(MemoryStore):
    """``get(key)`` runs ``self.stalls[key]`` (a coroutine function) first, if there is one."""

    def __init__(self) -> None:
        super().__init__()
        self.stalls: dict[str, Callable[[], Awaitable[Any]]] = {}

    async def get(self, key: str) -> IdempotencyRecord | None:
        stall = self.stalls.get(key)
        if stall is not None and await stall() == "swallowed":
            return None
        return await super().get(key)


def bounded(timeout: float) -> tuple[BoundedStore, Stalling]:
    store = Stalling()
    return BoundedStore(store, timeout=timeout, metrics=None, tracer=None), store


def sleeping(seconds: float) -> Callable[[], Awaitable[None]]:
    return lambda: asyncio.sleep(seconds)


async def assert_cancelled_from_outside(call: Awaitable[Any], *, once: asyncio.Event) -> None:
    """Run ``call`` as a task, cancel it once ``once`` is set: it ends cancelled."""
    task = asyncio.ensure_future(call)
    await once.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_call_within_its_deadline_returns_its_result() -> None:
    calls, store = bounded(1.0)
    store.stalls["k"] = sleeping(0)
    assert await calls.get("k") is None
    assert not calls._in_flight.get(asyncio.get_running_loop()).due


async def test_a_late_call_raises_store_timeout_error_soon_after_its_deadline() -> None:
    calls, store = bounded(0.1)
    store.stalls["k"] = sleeping(10)
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=r"longer than 0\.1s"):
        await calls.get("k")
    elapsed = time.monotonic() - started
    # Checked every timeout/20: late by at most one resolution, plus scheduling slack.
    assert 0.1 <= elapsed < 1.0
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # our cancellation was taken back


async def test_many_concurrent_calls_each_time_out_or_finish_on_their_own() -> None:
    calls, store = bounded(0.05)
    for seconds in (0, 0.01, 5):
        store.stalls[str(seconds)] = sleeping(seconds)
    for _ in range(20):
        results = await asyncio.gather(
            *(calls.get(key) for key in ("0", "0.01", "5", "0", "5")), return_exceptions=True
        )
        assert [type(r).__name__ for r in results] == [
            "NoneType",
            "NoneType",
            "StoreTimeoutError",
            "NoneType",
            "StoreTimeoutError",
        ]


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    calls, store = bounded(10.0)
    entered = asyncio.Event()

    async def stall() -> None:
        entered.set()
        await asyncio.sleep(10)

    store.stalls["k"] = stall
    await assert_cancelled_from_outside(calls.get("k"), once=entered)


async def test_an_outside_cancellation_after_our_deadline_stays_a_cancellation() -> None:
    calls, store = bounded(0.05)
    cancelled_by_us = asyncio.Event()

    async def stall() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled_by_us.set()
            await asyncio.sleep(10)  # still in the call: cancelled again from outside

    store.stalls["k"] = stall
    await assert_cancelled_from_outside(calls.get("k"), once=cancelled_by_us)


async def test_a_store_that_swallows_the_cancellation_leaves_the_task_clean() -> None:
    calls, store = bounded(0.05)

    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "swallowed"
        return "unreachable"

    store.stalls["k"] = stubborn
    assert await calls.get("k") is None
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
    assert not calls._in_flight.get(asyncio.get_running_loop()).late


async def test_the_timer_stops_once_no_call_is_in_flight() -> None:
    calls, store = bounded(0.1)
    store.stalls["k"] = sleeping(0.01)
    await calls.get("k")
    in_flight = calls._in_flight.get(asyncio.get_running_loop())
    assert not in_flight.due
    await eventually(lambda: in_flight.handle is None, message="the idle timer to stop")


def test_one_instance_serves_successive_event_loops() -> None:
    calls, store = bounded(0.05)
    store.stalls["late"] = sleeping(10)

    async def get(key: str) -> IdempotencyRecord | None:
        return await calls.get(key)

    for _ in range(3):
        with pytest.raises(StoreTimeoutError):
            asyncio.run(get("late"))
        assert asyncio.run(get("k")) is None
