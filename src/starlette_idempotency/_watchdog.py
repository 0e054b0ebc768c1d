"""The lock watchdog: a thread of its own keeps the locks of running handlers while their event
loop is blocked.

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

The thread starts with the first lock to watch and then waits, idle and without a timer, while
there is none; its store connections are closed when it goes idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time

from starlette_idempotency._timers import LockRenewal
from starlette_idempotency.errors import StoreError
from starlette_idempotency.observability import Observer
from starlette_idempotency.stores.base import IdempotencyStore, WatchdogStore

logger = logging.getLogger(__name__)

#: How late, past its interval, a loop's own renewal may be before the watchdog renews.
OVERDUE_SHARE = 0.5
#: The reason label a blocked loop is counted under.
BLOCKED_REASON = "event_loop_blocked"
_MIN_TICK_SECONDS = 0.01
_MAX_TICK_SECONDS = 0.25


class LockWatchdog:
    """One middleware's side of the watchdog: what its locks are renewed with (a connection
    of the watchdog's own to its store) and reported to (its observer)."""

    def __init__(self, store: IdempotencyStore, observer: Observer) -> None:
        self._keeper = _Keeper(store)
        self._observer = observer

    def watch(self, renewal: LockRenewal) -> None:
        """Watch ``renewal``'s lock until :meth:`unwatch` (called from its event loop)."""
        _THREAD.watch(renewal, self)

    def unwatch(self, renewal: LockRenewal) -> None:
        _THREAD.unwatch(renewal)

    def look_at(self, renewal: LockRenewal, now: float) -> None:
        """Renew ``renewal``'s lock if its loop's own renewal is overdue, and report its loop
        once it has been blocked for half the lock's TTL (in the watchdog's thread)."""
        if now - renewal.renewed_at >= renewal.interval * (1 + OVERDUE_SHARE):
            held = self._keeper.renew(renewal)
            if held:
                renewal.renewed_at = time.monotonic()
            elif held is False:  # taken over or gone: its loop's renewal sorts that out
                _THREAD.unwatch(renewal)
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

    :meth:`watch` and :meth:`unwatch` run in event loops, without a lock: the thread copies the
    dict in one step under the GIL. It sleeps on an event while nothing is watched; ``watch``
    sets it only when the thread says it sleeps (``_awake`` is lowered before the thread looks
    for locks one last time, and raised by ``watch`` after it added its own, so no lock is
    ever left unwatched).
    """

    def __init__(self) -> None:
        self._watched: dict[LockRenewal, LockWatchdog] = {}
        self._wake = threading.Event()
        self._awake = False
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()

    def watch(self, renewal: LockRenewal, watchdog: LockWatchdog) -> None:
        self._watched[renewal] = watchdog
        if not self._awake:
            if self._thread is None:
                self._start()
            self._wake.set()

    def unwatch(self, renewal: LockRenewal) -> None:
        self._watched.pop(renewal, None)

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
            self._awake = False
            if not self._watched:
                for watchdog in in_use:
                    watchdog.close()
                in_use.clear()
                self._wake.wait()
            self._wake.clear()
            self._awake = True
            while (tick := self._look_at_all(in_use)) is not None:
                time.sleep(tick)

    def _look_at_all(self, in_use: set[LockWatchdog]) -> float | None:
        """Look at every watched lock once; how long to wait before the next look (``None``
        when there is none). The locks are referred to only while this runs, so that a
        finished request's objects are not kept alive by the thread while it sleeps."""
        watched = self._watched.copy()
        if not watched:
            return None
        now = time.monotonic()
        for renewal, watchdog in watched.items():
            try:
                watchdog.look_at(renewal, now)
            except Exception:  # the watchdog must outlive any one lock's trouble
                logger.exception("the lock watchdog failed on a lock of %s", renewal.lock.endpoint)
            in_use.add(watchdog)
        tick = min(renewal.interval for renewal in watched) / 4
        return min(max(tick, _MIN_TICK_SECONDS), _MAX_TICK_SECONDS)

    def forget_thread(self) -> None:
        """In a child process made by ``fork``: the parent's thread did not come along."""
        self._watched.clear()
        self._wake = threading.Event()
        self._awake = False
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
