"""Keeping a running handler's lock: renewed from its event loop every third of its TTL, and
from the lock watchdog's thread while that loop is blocked.

A :class:`LockRenewal` waits in its event loop's ``LoopTimer`` until the first third of the
lock's TTL has passed, so a short handler costs no store round trip and no timer of its own;
then a task renews the lock every third. A failed renewal never aborts the handler.

A handler that blocks its event loop (an ``async def`` that computes without awaiting, or
calls something blocking) stops every renewal of that loop: its lock, and the lock of every
other request on the loop, would lapse after ``lock_ttl_seconds``, and a retry on another pod
would run the handler a second time. The watchdog is one thread per process, with a store
connection of its own for each middleware's store (the store's ``watchdog_store()``, opened in
the thread's own event loop). Every lock whose renewal by its own loop is overdue by half a
renewal interval, it renews itself, fenced as every renewal is (by the owner token, and only
while the record is ``InProgress``), so it never reopens a finished record nor extends a lock
that was taken over.

It also watches each loop's lag through the loop timer's ``checked_at`` (stamped at every check
while locks wait on it) and reports a loop blocked for half a lock's TTL: a warning naming the
route, and ``idempotency_processing_timeout_total{reason="event_loop_blocked"}``.

Limits: the thread needs the GIL, so a C call that holds it for longer than the lock stops the
watchdog too, as does a frozen process (``SIGSTOP``, a paused VM). A store without a
``watchdog_store()`` (``MemoryStore``, whose locks live in this process) gets the warning only.

The thread starts with the first lock to watch; once there has been none for a few seconds it
waits, idle and without a timer, until the next, and closes its store connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette_idempotency._timers import PerLoop
from starlette_idempotency.errors import StoreError
from starlette_idempotency.observability import Observer, RequestEvents
from starlette_idempotency.stores.base import IdempotencyStore, WatchdogStore

logger = logging.getLogger(__name__)


#: How late, at most, a renewal starts after its first third (less for short lock TTLs).
RENEWAL_RESOLUTION = 0.05


@dataclass(frozen=True, slots=True)
class HeldLock:
    """A lock as the store knows it, and the route it guards (for warnings and metrics)."""

    store_key: str
    owner_token: str
    lock_ttl: float
    endpoint: str


class LockRenewal:
    """Extends the lock every third of its TTL while the handler runs, until :meth:`stop`.

    It waits in its loop's timer and is watched by the watchdog thread from the start (a
    handler that blocks its loop at once would never let the loop renew). The watchdog reads
    ``renewed_at`` (and the timer's ``checked_at``) from its thread.
    """

    __slots__ = (
        "_context",
        "_events",
        "_renew",
        "_task",
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
        watchdog: LockWatchdog,
    ) -> None:
        """Call ``renew`` every third of ``lock.lock_ttl`` until it answers false (the key is
        held by someone else) or :meth:`stop`; ``events`` shows the key in warnings."""
        self._renew = renew
        self._events = events
        self.lock = lock
        self.interval = interval = lock.lock_ttl / 3
        loop = asyncio.get_running_loop()
        timers = watchdog.timers
        timer = timers.last
        if timer is None or timer.loop is not loop:
            timer = timers.get(loop)
        self.timer = timer
        if interval / 10 < timer.resolution:  # a short lock TTL needs a finer check
            timer.resolution = interval / 10
        self._task: asyncio.Task[None] | None = None
        # The renewal task starts from the loop timer's callback: give it this request's
        # context (tracing spans, log correlation), not the one that armed the timer.
        self._context = contextvars.copy_context()
        self.due = loop.time() + interval
        self.fired = False
        #: When (``time.monotonic``) the lock was last extended, by the loop or the watchdog.
        self.renewed_at = time.monotonic()
        #: Whether the watchdog has reported this lock's loop as blocked.
        self.lag_reported = False
        timer.entries.add(self)
        if timer.handle is None:
            timer.arm()
        thread = _THREAD
        thread.watched[self] = watchdog
        if tick_for(interval) < thread.sleeping_for:
            thread.wake()

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
        _THREAD.watched.pop(self, None)
        self.timer.entries.discard(self)
        if self._task is not None:
            self._task.cancel()


#: How late, past its interval, a loop's own renewal may be before the watchdog renews.
OVERDUE_SHARE = 0.5
#: The reason label a blocked loop is counted under.
BLOCKED_REASON = "event_loop_blocked"
_MIN_TICK_SECONDS = 0.01
_MAX_TICK_SECONDS = 0.25


def tick_for(interval: float) -> float:
    """How often the watchdog looks at a lock renewed every ``interval`` seconds."""
    return min(max(interval / 4, _MIN_TICK_SECONDS), _MAX_TICK_SECONDS)


#: How long the thread keeps ticking with no lock to watch before it waits to be woken.
_IDLE_AFTER_SECONDS = 5.0


class LockWatchdog:
    """One middleware's side of lock renewal: the timers its renewals wait on (one per event
    loop), and the watchdog's means for its locks: what they are renewed with (a connection of
    the watchdog's own to its store) and reported to (its observer)."""

    def __init__(self, store: IdempotencyStore, observer: Observer) -> None:
        self._keeper = _Keeper(store)
        self._observer = observer
        #: Where running handlers wait for their first lock renewal (one timer per loop).
        self.timers = PerLoop(RENEWAL_RESOLUTION)

    def look_at(self, renewal: LockRenewal, now: float) -> None:
        """Renew ``renewal``'s lock if its loop's own renewal is overdue, and report its loop
        once it has been blocked for half the lock's TTL (in the watchdog's thread)."""
        if now - renewal.renewed_at >= renewal.interval * (1 + OVERDUE_SHARE):
            held = self._keeper.renew(renewal)
            if held:
                renewal.renewed_at = time.monotonic()
            elif held is False:  # taken over or gone: its loop's renewal sorts that out
                _THREAD.watched.pop(renewal, None)
        lag = now - renewal.timer.checked_at
        if lag >= renewal.lock.lock_ttl / 2 and not renewal.lag_reported:
            renewal.lag_reported = True
            self._report_blocked(renewal, lag)

    def _report_blocked(self, renewal: LockRenewal, lag: float) -> None:
        lock = renewal.lock
        if self._keeper.can_renew:
            then = "the watchdog renews its lock from a thread of its own"
        else:
            then = (
                f"its lock cannot be renewed outside the loop with {self._keeper.store_name}, "
                f"and a retry after {lock.lock_ttl:g} s may run the handler again"
            )
        logger.warning(
            "the event loop has been blocked for %.1f s while %s held a lock of "
            "lock_ttl_seconds=%g: %s. Await in async handlers, or move blocking work to a "
            "thread (a sync def route, or anyio.to_thread.run_sync)",
            lag,
            lock.endpoint,
            lock.lock_ttl,
            then,
        )
        # Counted on the loop, where the metrics sink is always called; not on a closed one.
        with contextlib.suppress(RuntimeError):
            renewal.timer.loop.call_soon_threadsafe(
                self._observer.processing_timeout, lock.endpoint, BLOCKED_REASON
            )

    def close(self) -> None:
        """Close the watchdog's connection to the store, if it opened one (in its thread)."""
        self._keeper.close()


class _WatchdogThread:
    """The process's watchdog thread and the locks it watches, with their middleware's side.

    A renewal adds itself to :attr:`watched` and takes itself out, in its event loop and
    without a lock: the thread copies the dict in one step under the GIL. Between looks the
    thread sleeps on an event for :attr:`sleeping_for` seconds (forever while it is idle), and
    a renewal wakes it (:meth:`wake`) only when its lock needs a look sooner than that. The
    thread raises ``sleeping_for`` to infinity before it copies the dict, and a renewal reads
    it after it added its own lock, so a lock the copy missed always wakes the thread: no lock
    waits longer than its own tick for its first look.
    """

    def __init__(self) -> None:
        self.watched: dict[LockRenewal, LockWatchdog] = {}
        self._wake = threading.Event()
        #: How long the thread sleeps before its next look (infinite while idle or looking).
        self.sleeping_for = math.inf
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def wake(self) -> None:
        """Start the thread if it has not been, and wake it."""
        if self._thread is None:
            self._start()
        self._wake.set()

    def _start(self) -> None:
        with self._starting:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="starlette-idempotency-watchdog", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        in_use: set[LockWatchdog] = set()
        while True:
            self.sleeping_for = math.inf
            if not self.watched:
                for watchdog in in_use:
                    watchdog.close()
                in_use.clear()
                self._wake.wait()
            self._watch(in_use)

    def _watch(self, in_use: set[LockWatchdog]) -> None:
        """Look at the watched locks every tick until none has been watched for a while.

        Under load the locks come and go between ticks (a short handler holds one for a few
        milliseconds); going idle at each gap would make every other request wake the thread,
        and each wake costs the event loop a hand-over of the GIL."""
        idle_since: float | None = None
        while True:
            self._wake.clear()
            self.sleeping_for = math.inf  # a lock added from here on wakes the thread
            tick = self._look_at_all(in_use)
            if tick is None:
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= _IDLE_AFTER_SECONDS:
                    return
                tick = _MAX_TICK_SECONDS
            else:
                idle_since = None
            self.sleeping_for = tick
            self._wake.wait(tick)

    def _look_at_all(self, in_use: set[LockWatchdog]) -> float | None:
        """Look at every watched lock once; how long to wait before the next look (``None``
        when there is none). The locks are referred to only while this runs, so that a
        finished request's objects are not kept alive by the thread while it sleeps."""
        watched = self.watched.copy()
        if not watched:
            return None
        now = time.monotonic()
        for renewal, watchdog in watched.items():
            try:
                watchdog.look_at(renewal, now)
            except Exception:  # the watchdog must outlive any one lock's trouble
                logger.exception("the lock watchdog failed on a lock of %s", renewal.lock.endpoint)
            in_use.add(watchdog)
        return tick_for(min(renewal.interval for renewal in watched))

    def forget_thread(self) -> None:
        """In a child process made by ``fork``: the parent's thread did not come along."""
        self.watched.clear()
        self._wake = threading.Event()
        self.sleeping_for = math.inf
        self._thread = None
        self._starting = threading.Lock()


_THREAD = _WatchdogThread()
os.register_at_fork(after_in_child=_THREAD.forget_thread)


class _Keeper:
    """A connection of the watchdog's own to one store, opened on the first renewal (in an
    event loop of the watchdog thread's own) and closed when the thread goes idle."""

    def __init__(self, store: IdempotencyStore) -> None:
        self._store = store
        self.store_name = type(store).__name__
        self._loop: asyncio.AbstractEventLoop | None = None
        self._own: IdempotencyStore | None = None
        #: Whether locks can be renewed here (until a store shows it cannot).
        self.can_renew = isinstance(store, WatchdogStore)

    def renew(self, renewal: LockRenewal) -> bool | None:
        """Renew ``renewal``'s lock: whether it is still held, ``None`` when not known (no
        connection of its own, or the store failed)."""
        if not self.can_renew:
            return None
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        lock = renewal.lock
        try:
            return self._loop.run_until_complete(self._renew(renewal))
        except (StoreError, TimeoutError) as exc:
            logger.warning("the watchdog could not renew a lock of %s: %s", lock.endpoint, exc)
            return None

    async def _renew(self, renewal: LockRenewal) -> bool | None:
        lock = renewal.lock
        async with asyncio.timeout(renewal.interval):
            if self._own is None:
                assert isinstance(self._store, WatchdogStore)
                self._own = await self._store.watchdog_store()
                if self._own is None:
                    self.can_renew = False
                    return None
            return await self._own.renew(lock.store_key, lock.owner_token, lock.lock_ttl)

    def close(self) -> None:
        loop, own, self._loop, self._own = self._loop, self._own, None, None
        if loop is None:
            return
        try:
            if own is not None:
                loop.run_until_complete(own.aclose())
        except Exception as exc:
            logger.debug("closing the watchdog's store connection: %s", exc)
        finally:
            loop.close()
