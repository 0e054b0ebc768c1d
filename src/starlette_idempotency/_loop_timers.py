"""One timer per event loop for many short-lived timeouts, instead of a timer each.

A request that schedules and cancels a timer of its own pays for it twice: ``call_later`` and
``cancel`` cost about 4 µs on uvloop, and a cancelled uvloop timer leaves a reference cycle
(its ``TimerHandle`` and ``UVTimer``) that only the garbage collector frees. Here an entry
only enters and leaves a set; one timer per event loop, armed only while entries wait, fires
those whose time has come. Store-call deadlines and lock renewals both use it.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Protocol


class Timed(Protocol):
    """An entry: fired once, at the first check after ``due`` (loop time)."""

    due: float
    fired: bool

    def fire(self) -> None: ...


class LoopTimer:
    """The entries waiting on one event loop, and the timer that checks them every
    ``resolution`` seconds while there are any."""

    def __init__(self, loop: asyncio.AbstractEventLoop, resolution: float) -> None:
        self.loop = loop
        self.resolution = resolution
        self.entries: set[Timed] = set()
        self._timer: asyncio.TimerHandle | None = None
        #: When (``time.monotonic``) the loop last ran a check: while entries wait, a loop
        #: whose last check is much older than ``resolution`` is blocked (the lock watchdog,
        #: in a thread of its own, reads it).
        self.checked_at = time.monotonic()

    @property
    def armed(self) -> bool:
        """Whether the timer is scheduled (only while entries wait, and one check after)."""
        return self._timer is not None

    def add(self, entry: Timed) -> None:
        self.entries.add(entry)
        if self._timer is None:
            self.checked_at = time.monotonic()
            self._timer = self.loop.call_later(self.resolution, self._check)

    def discard(self, entry: Timed) -> None:
        self.entries.discard(entry)

    def _check(self) -> None:
        self.checked_at = time.monotonic()
        now = self.loop.time()
        due = [entry for entry in self.entries if not entry.fired and entry.due <= now]
        # Re-armed before firing: an entry whose fire() fails cannot stop the others' timer.
        self._timer = self.loop.call_later(self.resolution, self._check) if self.entries else None
        for entry in due:
            entry.fired = True
            entry.fire()


class PerLoop:
    """One :class:`LoopTimer` per event loop; the last one used is found without a lookup."""

    def __init__(self, resolution: float) -> None:
        self.resolution = resolution
        self._timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTimer] = (
            weakref.WeakKeyDictionary()
        )
        self.last: LoopTimer | None = None

    def get(self, loop: asyncio.AbstractEventLoop) -> LoopTimer:
        timer = self.last
        if timer is None or timer.loop is not loop:
            timer = self._timers.get(loop)
            if timer is None:
                timer = self._timers[loop] = LoopTimer(loop, self.resolution)
            self.last = timer
        return timer
