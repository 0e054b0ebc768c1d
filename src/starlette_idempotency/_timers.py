"""Timers: one per event loop for many short-lived timeouts, and the store calls' deadlines.

A request that schedules and cancels a timer of its own pays for it twice: ``call_later`` and
``cancel`` cost about 4 µs on uvloop, and a cancelled uvloop timer leaves a reference cycle
(its ``TimerHandle`` and ``UVTimer``) that only the garbage collector frees. Here an entry
only enters and leaves a set; one timer per event loop (:class:`LoopTimer`), armed only while
entries wait, fires those whose time has come.

Store-call deadlines (:class:`CallDeadlines`) bound a call with such an entry instead of
``asyncio.timeout``; their cancellation protocol is the one ``asyncio.timeout`` uses
(``Task.cancel``, then ``Task.uncancel`` to tell our cancellation from anyone else's), so a
request cancelled from outside during a store call stays cancelled.

Lock renewals wait on timers of their own (``_renewal``), which also report a loop that was
blocked: a check that comes much later than its resolution says the loop ran nothing between.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol


class Timed(Protocol):
    """An entry: fired once, at the first check after ``due`` (loop time)."""

    due: float
    fired: bool

    def fire(self) -> None: ...


#: Told, in the loop, that its timer's check came ``gap`` seconds after the previous one.
GapHook = Callable[["LoopTimer", float], None]


class LoopTimer:
    """The entries waiting on one event loop, and the timer that checks them every
    ``resolution`` seconds while there are any."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, resolution: float, on_gap: GapHook | None = None
    ) -> None:
        self.loop = loop
        self.resolution = resolution
        self.entries: set[Timed] = set()
        #: The scheduled check, while entries wait (and one check after).
        self.handle: asyncio.TimerHandle | None = None
        #: When (``time.monotonic``) the loop last ran a check.
        self.checked_at = time.monotonic()
        self._on_gap = on_gap

    @property
    def armed(self) -> bool:
        """Whether the timer is scheduled (only while entries wait, and one check after)."""
        return self.handle is not None

    def add(self, entry: Timed) -> None:
        self.entries.add(entry)
        if self.handle is None:
            self.arm()

    def arm(self) -> None:
        """Schedule the next check (entries were added while none was scheduled)."""
        self.checked_at = time.monotonic()
        self.handle = self.loop.call_later(self.resolution, self._check)

    def discard(self, entry: Timed) -> None:
        self.entries.discard(entry)

    def _check(self) -> None:
        checked_at = time.monotonic()
        gap = checked_at - self.checked_at
        self.checked_at = checked_at
        if self._on_gap is not None and gap > 4 * self.resolution:  # the loop was blocked
            self._on_gap(self, gap)
        now = self.loop.time()
        due = [entry for entry in self.entries if not entry.fired and entry.due <= now]
        # Re-armed before firing: an entry whose fire() fails cannot stop the others' timer.
        self.handle = self.loop.call_later(self.resolution, self._check) if self.entries else None
        for entry in due:
            entry.fired = True
            entry.fire()


class PerLoop:
    """One :class:`LoopTimer` per event loop; the last one used is found without a lookup."""

    def __init__(self, resolution: float, on_gap: GapHook | None = None) -> None:
        self.resolution = resolution
        self._on_gap = on_gap
        self._timers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopTimer] = (
            weakref.WeakKeyDictionary()
        )
        self.last: LoopTimer | None = None

    def get(self, loop: asyncio.AbstractEventLoop) -> LoopTimer:
        timer = self.last
        if timer is None or timer.loop is not loop:
            timer = self._timers.get(loop)
            if timer is None:
                timer = self._timers[loop] = LoopTimer(loop, self.resolution, self._on_gap)
            self.last = timer
        return timer


_MAX_RESOLUTION = 0.05
_UNBOUNDED: AbstractContextManager[None] = nullcontext()


class _Bound:
    """One bounded call: ``with deadlines.bound(): await ...`` (a plain context manager, so
    bounding a call adds no coroutine frame)."""

    __slots__ = ("cancelling", "due", "fired", "task", "timer")

    def __init__(self, task: asyncio.Task[Any], timer: LoopTimer, timeout: float) -> None:
        self.task = task
        self.timer = timer
        self.fired = False
        self.due = timer.loop.time() + timeout
        self.cancelling = task.cancelling()

    def fire(self) -> None:
        self.task.cancel()

    def __enter__(self) -> None:
        self.timer.add(self)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: object
    ) -> None:
        self.timer.discard(self)
        if not self.fired:
            return
        # Ours to take back; a CancelledError beyond ours (someone else's) stays one.
        if self.task.uncancel() <= self.cancelling and kind is asyncio.CancelledError:
            raise TimeoutError from exc


class CallDeadlines:
    """Bounds calls to ``timeout`` seconds: ``with deadlines.bound(): await call()`` raises
    ``TimeoutError`` once the call is late.

    A call is cancelled between ``timeout`` and ``timeout + resolution`` seconds after it
    started, where ``resolution`` is a twentieth of ``timeout``, at most 50 ms.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.timers = PerLoop(min(_MAX_RESOLUTION, timeout / 20))

    def bound(self) -> AbstractContextManager[None]:
        """A context manager bounding the awaits inside it (none outside a task)."""
        task = asyncio.current_task()
        if task is None:
            return _UNBOUNDED
        return _Bound(task, self.timers.get(task.get_loop()), self.timeout)
