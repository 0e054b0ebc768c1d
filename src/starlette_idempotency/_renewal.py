"""Keeping a running handler's lock: renewed from its own event loop every third of its TTL,
for at most ``max_processing_seconds``.

The run of a request (``_lease.Run``) waits in its event loop's timer (``_timers.LoopTimer``)
until the first third of the lock's TTL has passed, so a short handler costs no store round
trip, no timer and no object of its own; a handler that outlives it gets a
:class:`LockRenewal`, whose task renews the lock every third. A failed renewal never aborts
the handler.

The lease is honest: nothing outside the request's loop keeps it. A handler that blocks its
loop (an ``async def`` that computes without awaiting, a blocking call), a frozen process or a
long collector pause stop the renewals, and after ``lock_ttl_seconds`` a retry on another pod
may take the key over and run the handler again. What keeps the effect once then is fencing
where it commits: ``idempotency_transaction`` (the outcome in the app's own transaction, which
a lapsed owner cannot commit) and ``derived_key`` (the provider drops the second attempt). The
loop's timer sees the gap when the loop runs again and reports it: a warning naming the route,
and ``idempotency_processing_timeout_total{reason="event_loop_blocked"}``.

A handler still running after ``max_processing_seconds`` is taken for hung: its renewals end
(a warning, and ``reason="max_processing_seconds"``), so its key is free one lock TTL later
instead of for as long as the process lives.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from starlette_idempotency._timers import LoopTimer, PerLoop, Timed
from starlette_idempotency.errors import StoreError
from starlette_idempotency.observability import Observer, RequestEvents

logger = logging.getLogger(__name__)


#: How late, at most, a renewal starts after its first third (less for short lock TTLs).
RENEWAL_RESOLUTION = 0.05
#: The reason label a blocked loop is counted under.
BLOCKED_REASON = "event_loop_blocked"
#: The reason label a handler that outran ``max_processing_seconds`` is counted under.
MAX_PROCESSING_REASON = "max_processing_seconds"


@dataclass(frozen=True, slots=True)
class HeldLock:
    """A held lock's durations, and the route it guards (for warnings and metrics)."""

    lock_ttl: float
    endpoint: str
    #: How long the lock is renewed for at most (``max_processing_seconds``).
    max_processing: float


@runtime_checkable
class AwaitingRenewal(Timed, Protocol):
    """What waits in the loop's renewal timer for its lock's first third (the run of a
    request whose route renews its lock): fired then, and told of a blocked loop."""

    def blocked(self, gap: float) -> None: ...


class LockRenewal:
    """Extends the lock every third of its TTL, from the first third on (when a handler
    outlives it), until :meth:`stop` or ``max_processing_seconds``."""

    __slots__ = ("_events", "_observer", "_renew", "_task", "give_up_at", "interval", "lock")

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        events: RequestEvents,
        lock: HeldLock,
        observer: Observer,
        *,
        started: float,
        context: contextvars.Context,
    ) -> None:
        """Call ``renew`` now and every third of ``lock.lock_ttl`` until it answers false
        (nothing left to renew) or :meth:`stop`, in the request's ``context`` (tracing spans,
        log correlation); ``started`` is when the lock was taken (loop time)."""
        self._renew = renew
        self._events = events
        self._observer = observer
        self.lock = lock
        self.interval = lock.lock_ttl / 3
        self.give_up_at = started + lock.max_processing
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), context=context)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            if started >= self.give_up_at:
                self._give_up()
                return
            try:
                held = await self._renew()
            except StoreError as exc:
                logger.warning(
                    "could not renew the lock for %r: %s",
                    self._events.shown_key,
                    self._events.shown_error(exc),
                )
            else:
                if not held:  # nothing left to renew; renew reported why
                    return
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    def _give_up(self) -> None:
        lock = self.lock
        logger.warning(
            "%s has run for longer than max_processing_seconds=%g while holding idempotency "
            "key %r: its lock is no longer renewed and ends within lock_ttl_seconds=%g, after "
            "which a retry runs the handler again. Raise max_processing_seconds on the route "
            "if it is meant to run that long",
            lock.endpoint,
            lock.max_processing,
            self._events.shown_key,
            lock.lock_ttl,
        )
        self._observer.processing_timeout(lock.endpoint, MAX_PROCESSING_REASON)

    def stop(self) -> None:
        self._task.cancel()


def report_blocked(lock: HeldLock, events: RequestEvents, observer: Observer, gap: float) -> None:
    """The loop ran nothing for ``gap`` seconds while ``lock`` was held (half its TTL or
    more): no renewal could run, and another pod may have taken the key over."""
    logger.warning(
        "the event loop was blocked for %.1f s while %s held a lock of "
        "lock_ttl_seconds=%g: no renewal could run, and a retry after %g s may have taken "
        "the key over and run the handler again. Await in async handlers, or move blocking "
        "work to a thread (a sync def route, or anyio.to_thread.run_sync); commit effects "
        "with idempotency_transaction or send them with a derived_key, so that they stay once",
        gap,
        lock.endpoint,
        lock.lock_ttl,
        lock.lock_ttl,
    )
    observer.processing_timeout(lock.endpoint, BLOCKED_REASON)


def _report_gap(timer: LoopTimer, gap: float) -> None:
    for waiting in list(timer.entries):
        assert isinstance(waiting, AwaitingRenewal)
        waiting.blocked(gap)


class LockRenewals:
    """One middleware's lock renewals: the timers runs wait on for their lock's first third
    (one per event loop, each reporting the gaps of a blocked loop) and the observer their
    warnings count in."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer
        #: Where running handlers wait for their first lock renewal (one timer per loop).
        self.timers = PerLoop(lambda loop: LoopTimer(loop, RENEWAL_RESOLUTION, _report_gap))
