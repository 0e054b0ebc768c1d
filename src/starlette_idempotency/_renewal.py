"""Keeping a slow but alive handler's lock: extend it every third of its TTL, from the event
loop, and from the lock watchdog's thread when the loop is blocked."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from starlette_idempotency._loop_timers import PerLoop
from starlette_idempotency._request_events import RequestEvents
from starlette_idempotency.errors import StoreError

logger = logging.getLogger(__name__)


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
    :class:`~starlette_idempotency._loop_timers.LoopTimer`, so a short handler costs no store
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
