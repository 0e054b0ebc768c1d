"""LoopTimer: one timer per event loop fires each waiting entry once, after its time."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette_idempotency._timers import LoopTimer, PerLoop
from tests.support.conditions import eventually


class Entry:
    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, *, fails: bool = False):
        self.due = loop.time() + delay
        self.fired = False
        self.fires = 0
        self._fails = fails

    def fire(self) -> None:
        self.fires += 1
        if self._fails:
            raise RuntimeError("this entry's fire() fails")


def add(timer: LoopTimer, entry: Entry) -> None:
    timer.entries.add(entry)
    if timer.handle is None:
        timer.arm()


async def test_entries_fire_once_after_their_time_and_the_timer_disarms() -> None:
    loop = asyncio.get_running_loop()
    timer = LoopTimer(loop, 0.01)
    soon, later = Entry(loop, 0.02), Entry(loop, 0.2)
    add(timer, soon)
    add(timer, later)

    await eventually(lambda: soon.fires == 1, message="the first entry to fire")
    assert later.fires == 0
    await eventually(lambda: later.fires == 1, message="the second entry to fire")
    timer.entries.discard(soon)
    timer.entries.discard(later)
    await eventually(lambda: not timer.armed, message="the timer to disarm")
    assert (soon.fires, later.fires) == (1, 1)


async def test_an_entry_that_fails_to_fire_does_not_stop_the_others() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        timer = LoopTimer(loop, 0.01)
        failing, fine = Entry(loop, 0.0, fails=True), Entry(loop, 0.05)
        add(timer, failing)
        add(timer, fine)

        await eventually(lambda: fine.fires == 1, message="the other entry to fire")
        assert failing.fires == 1
        assert [str(error["exception"]) for error in errors] == ["this entry's fire() fails"]
    finally:
        loop.set_exception_handler(None)


def test_per_loop_makes_one_timer_per_event_loop() -> None:
    timers = PerLoop(lambda loop: LoopTimer(loop, 0.05))

    async def timer_of_this_loop() -> tuple[LoopTimer, LoopTimer]:
        loop = asyncio.get_running_loop()
        return timers.get(loop), timers.get(loop)

    first, again = asyncio.run(timer_of_this_loop())
    other, _ = asyncio.run(timer_of_this_loop())
    assert first is again
    assert other is not first
    assert timers.last is other
