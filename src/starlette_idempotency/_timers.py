"""Timers: one per event loop for many short-lived timeouts, the store calls' deadlines, and
the renewal of running handlers' locks.

A request that schedules and cancels a timer of its own pays for it twice: ``call_later`` and
``cancel`` cost about 4 µs on uvloop, and a cancelled uvloop timer leaves a reference cycle
(its ``TimerHandle`` and ``UVTimer``) that only the garbage collector frees. Here an entry
only enters and leaves a set; one timer per event loop (:class:`LoopTimer`), armed only while
entries wait, fires those whose time has come.

Store-call deadlines (:class:`CallDeadlines`) bound a call with such an entry instead of
``asyncio.timeout``; their cancellation protocol is the one ``asyncio.timeout`` uses
(``Task.cancel``, then ``Task.uncancel`` to tell our cancellation from anyone else's), so a
request cancelled from outside during a store call stays cancelled.

A slow but alive handler's lock is extended every third of its TTL (:class:`LockRenewal`), from
the event loop, and from the lock watchdog's thread when the loop is blocked.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from starlette_idempotency.errors import StoreError
from starlette_idempotency.observability import RequestEvents

logger = logging.getLogger(__name__)


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


#: How late, at most, a renewal starts after its first third (less for short lock TTLs).
RENEWAL_RESOLUTION = 0.05


class Watchdog(Protocol):
    """What renews locks while their event loop is blocked (``_watchdog.LockWatchdog``)."""

    def watch(self, renewal: LockRenewal) -> None: ...

    def unwatch(self, renewal: LockRenewal) -> None: ...


@dataclass(frozen=True, slots=True)
class Renewals:
    """Where the locks of running handlers are kept alive: one timer per event loop, and the
    watchdog that renews them from a thread of its own while a loop is blocked."""

    timers: PerLoop
    watchdog: Watchdog


@dataclass(frozen=True, slots=True)
class HeldLock:
    """A lock as the store knows it, and the route it guards (for warnings and metrics)."""

    store_key: str
    owner_token: str
    lock_ttl: float
    endpoint: str


class LockRenewal:
    """Extends the lock every third of its TTL while the handler runs.

    Until the first third has passed the request only waits in its event loop's
    :class:`LoopTimer`, so a short handler costs no store
    round trip and no timer of its own. A failed renewal never aborts the handler. The
    watchdog reads ``renewed_at`` (and the timer's ``checked_at``) from its thread.
    """

    __slots__ = (
        "_context",
        "_events",
        "_renew",
        "_task",
        "_watchdog",
        "due",
        "fired",
        "interval",
        "lag_reported",
        "lock",
        "renewed_at",
        "timer",
    )

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        events: RequestEvents,
        lock: HeldLock,
        renewals: Renewals,
    ) -> None:
        """Call ``renew`` every third of ``lock.lock_ttl`` until it answers false (the key is
        held by someone else) or :meth:`stop`; ``events`` shows the key in warnings."""
        self._renew = renew
        self._events = events
        self.lock = lock
        self.interval = interval = lock.lock_ttl / 3
        self.timer = timer = renewals.timers.get(asyncio.get_running_loop())
        if interval / 10 < timer.resolution:  # a short lock TTL needs a finer check
            timer.resolution = interval / 10
        self._task: asyncio.Task[None] | None = None
        # The renewal task starts from the loop timer's callback: give it this request's
        # context (tracing spans, log correlation), not the one that armed the timer.
        self._context = contextvars.copy_context()
        self.due = timer.loop.time() + interval
        self.fired = False
        #: When (``time.monotonic``) the lock was last extended, by the loop or the watchdog.
        self.renewed_at = time.monotonic()
        #: Whether the watchdog has reported this lock's loop as blocked.
        self.lag_reported = False
        timer.add(self)
        self._watchdog = renewals.watchdog
        self._watchdog.watch(self)

    def fire(self) -> None:
        self._task = self.timer.loop.create_task(self._loop(), context=self._context)

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                held = await self._renew()
            except StoreError as exc:
                logger.warning(
                    "could not renew the lock for %r: %s",
                    self._events.shown_key,
                    self._events.shown_error(exc),
                )
            else:
                if not held:  # another request holds the key; renew reported it
                    return
                self.renewed_at = time.monotonic()
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._watchdog.unwatch(self)
        self.timer.discard(self)
        if self._task is not None:
            self._task.cancel()
