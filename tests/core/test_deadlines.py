"""CallDeadlines: store-call timeouts with one timer per event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from starlette_idempotency._timers import CallDeadlines
from tests.support.conditions import eventually


async def _bounded(deadlines: CallDeadlines, seconds: float) -> str:
    with deadlines.bound():
        await asyncio.sleep(seconds)
    return "done"


async def assert_cancelled_from_outside(
    call: Coroutine[Any, Any, None], *, once: asyncio.Event
) -> None:
    """Run ``call`` as a task, cancel it once ``once`` is set: it ends cancelled."""
    task = asyncio.create_task(call)
    await once.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_call_within_its_deadline_returns_its_result() -> None:
    deadlines = CallDeadlines(1.0)
    assert await _bounded(deadlines, 0) == "done"


async def test_a_late_call_raises_timeout_error_soon_after_its_deadline() -> None:
    deadlines = CallDeadlines(0.1)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await _bounded(deadlines, 10)
    elapsed = time.monotonic() - started
    # Checked every timeout/20: late by at most one resolution, plus scheduling slack.
    assert 0.1 <= elapsed < 1.0
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0  # our cancellation was taken back


async def test_many_concurrent_calls_each_time_out_or_finish_on_their_own() -> None:
    deadlines = CallDeadlines(0.05)
    for _ in range(20):
        results = await asyncio.gather(
            *(_bounded(deadlines, seconds) for seconds in (0, 0.01, 5, 0, 5)),
            return_exceptions=True,
        )
        assert [type(r).__name__ for r in results] == [
            "str",
            "str",
            "TimeoutError",
            "str",
            "TimeoutError",
        ]


async def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    deadlines = CallDeadlines(10.0)
    entered = asyncio.Event()

    async def call() -> None:
        with deadlines.bound():
            entered.set()
            await asyncio.sleep(10)

    await assert_cancelled_from_outside(call(), once=entered)


async def test_an_outside_cancellation_after_our_deadline_stays_a_cancellation() -> None:
    deadlines = CallDeadlines(0.05)
    cancelled_by_us = asyncio.Event()

    async def call() -> None:
        with deadlines.bound():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled_by_us.set()
                await asyncio.sleep(10)  # still inside the bound: cancelled again from outside

    await assert_cancelled_from_outside(call(), once=cancelled_by_us)


async def test_an_operation_that_swallows_the_cancellation_leaves_the_task_clean() -> None:
    deadlines = CallDeadlines(0.05)

    async def stubborn() -> str:
        with deadlines.bound():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "swallowed"
        return "unreachable"

    assert await stubborn() == "swallowed"
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_the_timer_stops_once_no_call_is_in_flight() -> None:
    deadlines = CallDeadlines(0.1)
    await _bounded(deadlines, 0.01)
    timer = deadlines.timers.last
    assert timer is not None
    assert not timer.entries
    await eventually(lambda: not timer.armed, message="the idle timer to stop")


def test_one_instance_serves_successive_event_loops() -> None:
    deadlines = CallDeadlines(0.05)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            asyncio.run(_bounded(deadlines, 10))
        assert asyncio.run(_bounded(deadlines, 0)) == "done"


async def test_outside_a_task_nothing_is_bounded() -> None:
    deadlines = CallDeadlines(0.05)
    done = asyncio.Event()

    def callback() -> None:  # runs on the loop, but in no task
        with deadlines.bound():
            done.set()

    asyncio.get_running_loop().call_soon(callback)
    await asyncio.wait_for(done.wait(), 5)
    assert deadlines.timers.last is None  # nothing was watched
