"""Keeping a slow but alive handler's lock: extend it every third of its TTL."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

from starlette_idempotency._loop_timers import PerLoop
from starlette_idempotency._request_events import RequestEvents
from starlette_idempotency.errors import StoreError

logger = logging.getLogger(__name__)


#: How late, at most, a renewal starts after its first third (less for short lock TTLs).
RENEWAL_RESOLUTION = 0.05


class LockRenewal:
    """Extends the lock every third of its TTL while the handler runs.

    Until the first third has passed the request only waits in its event loop's
    :class:`~starlette_idempotency._loop_timers.LoopTimer`, so a short handler costs no store
    round trip and no timer of its own. A failed renewal never aborts the handler.
    """

    __slots__ = ("_context", "_events", "_interval", "_renew", "_task", "_timer", "due", "fired")

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        events: RequestEvents,
        lock_ttl: float,
        timers: PerLoop,
    ) -> None:
        """Call ``renew`` every third of ``lock_ttl`` until it answers false (the key is held
        by someone else) or :meth:`stop`; ``events`` shows the key in warnings."""
        self._renew = renew
        self._events = events
        self._interval = interval = lock_ttl / 3
        self._timer = timer = timers.get(asyncio.get_running_loop())
        if interval / 10 < timer.resolution:  # a short lock TTL needs a finer check
            timer.resolution = interval / 10
        self._task: asyncio.Task[None] | None = None
        # The renewal task starts from the loop timer's callback: give it this request's
        # context (tracing spans, log correlation), not the one that armed the timer.
        self._context = contextvars.copy_context()
        self.due = timer.loop.time() + interval
        self.fired = False
        timer.add(self)

    def fire(self) -> None:
        self._task = self._timer.loop.create_task(self._loop(), context=self._context)

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
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._timer.discard(self)
        if self._task is not None:
            self._task.cancel()
