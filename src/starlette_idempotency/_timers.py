"""Timers: one per event loop for many short-lived timeouts, and the store calls' deadlines.

A request that schedules and cancels a timer of its own pays for it twice: ``call_later`` and
``cancel`` cost about 4 µs on uvloop, and a cancelled uvloop timer leaves a reference cycle
(its ``TimerHandle`` and ``UVTimer``) that only the garbage collector frees. Here an entry
only enters and leaves a set; one timer per event loop (:class:`LoopTimer`), armed only while
entries wait, fires those whose time has come.

Store-call deadlines (:class:`CallsInFlight`) cost less still: a call's task enters a dict
and leaves it, and one timer per loop cancels a call that is late. Their cancellation protocol
is the one ``asyncio.timeout`` uses (``Task.cancel``, then ``Task.uncancel`` to tell our
cancellation from anyone else's), so a request cancelled from outside during a store call stays
cancelled.

Lock renewals wait on timers of their own (``_renewal``), which also report a loop that was
blocked: a check that comes much later than its resolution says the loop ran nothing between.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class Timed(Protocol):
    """An entry: fired once, at the first check after ``due`` (loop time)."""

    due: float
    fired: bool

    def fire(self) -> None: ...


_PerLoopT = TypeVar("_PerLoopT")

#: Told, in the loop, that its timer's check came ``gap`` seconds after the previous one.
GapHook = Callable[["LoopTimer", float], None]


class LoopTimer:
    """The entries waiting on one event loop, and the timer that checks them every
    ``resolution`` seconds while there are any.

    An entry enters :attr:`entries` (calling :meth:`arm` when :attr:`handle` is ``None``) and
    leaves it: set operations, so waiting costs a request no call.
    """

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

    def arm(self) -> None:
        """Schedule the next check (an entry was added while none was scheduled)."""
        self.checked_at = time.monotonic()
        self.handle = self.loop.call_later(self.resolution, self._check)

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


class PerLoop(Generic[_PerLoopT]):
    """One ``made(loop)`` per event loop. :attr:`last` is the one :meth:`get` gave last: a
    caller on the same loop takes it without a lookup (or a call)."""

    def __init__(self, made: Callable[[asyncio.AbstractEventLoop], _PerLoopT]) -> None:
        self._made = made
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _PerLoopT] = (
            weakref.WeakKeyDictionary()
        )
        self.last: _PerLoopT | None = None

    def get(self, loop: asyncio.AbstractEventLoop) -> _PerLoopT:
        found = self._by_loop.get(loop)
        if found is None:
            found = self._by_loop[loop] = self._made(loop)
        self.last = found
        return found


_MAX_RESOLUTION = 0.05


class CallsInFlight:
    """The store calls in flight on one event loop, and the timer that cancels the late ones.

    A call costs two dict writes: its task enters :attr:`due` with the loop time it must
    answer by, and leaves it when it ends (no object, timer handle or ``asyncio.timeout`` per
    call; see ``BoundedStore``). While calls are in
    flight a check runs every :attr:`resolution` seconds; the task of a late call is
    cancelled and enters :attr:`late`, so the call can tell its deadline's cancellation from
    anyone else's (``Task.uncancel``, as ``asyncio.timeout`` does). A call is cancelled between
    ``timeout`` and ``timeout + resolution`` seconds after it started.
    """

    __slots__ = ("due", "handle", "late", "loop", "resolution")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.loop = loop
        self.resolution = min(_MAX_RESOLUTION, timeout / 20)
        #: The tasks in a store call, and the loop time each must be answered by.
        self.due: dict[asyncio.Task[Any], float] = {}
        #: The tasks whose call this timer cancelled, until the call has seen it.
        self.late: set[asyncio.Task[Any]] = set()
        self.handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Schedule the next check (a call began while none was scheduled)."""
        self.handle = self.loop.call_later(self.resolution, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        for task, due in self.due.items():
            if due <= now and task not in self.late:
                self.late.add(task)
                task.cancel()
        self.handle = self.loop.call_later(self.resolution, self._check) if self.due else None
