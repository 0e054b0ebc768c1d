"""Keeping a slow but alive handler's lock: extend it every third of its TTL."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starlette_idempotency.errors import StoreError

if TYPE_CHECKING:
    from starlette_idempotency.guarded import GuardedRequest

logger = logging.getLogger(__name__)


class LockRenewal:
    """Extends the lock every third of its TTL while the handler runs.

    Nothing is scheduled but a timer until the first third has passed, so short handlers cost
    no store round trip. A failed renewal never aborts the handler.
    """

    def __init__(self, request: GuardedRequest) -> None:
        self._request = request
        self._interval = request.policy.lock_ttl_seconds / 3
        loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = loop.call_later(self._interval, self._start)
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        request = self._request
        while True:
            started = time.monotonic()
            try:
                renewed = await request.renew_lock()
            except StoreError as exc:
                logger.warning("could not renew the lock for %r: %s", request.key, exc)
            else:
                if not renewed:
                    logger.warning("lock for %r is gone; renewal stopped", request.key)
                    request.mw.observer.processing_timeout(
                        request._endpoint(), "renewal_found_gone"
                    )
                    return
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
