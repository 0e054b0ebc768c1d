"""Duplicates that wait for the first request instead of getting a 409 (``on_in_progress="wait"``).

All duplicates of one key waiting in this process share one watcher, which reads the key only
when the store announces a change (``wait_for_change``, e.g. Redis pub/sub) or, at the latest,
once a second, and otherwise backs off from 50 ms. A thousand waiting duplicates of one key so
cost the store about one read a second, and a store without notifications is simply polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from starlette_idempotency._record import IdempotencyRecord, RecordStatus
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency.errors import StoreError
from starlette_idempotency.observability import error_summary
from starlette_idempotency.stores.base import ChangeNotifyingStore

logger = logging.getLogger(__name__)

_FIRST_POLL_SECONDS = 0.05
_MAX_POLL_SECONDS = 1.0


class KeyWatch:
    """Watches one key for the waiters of this process; wakes them when its holder changes."""

    def __init__(self, key: str, store: BoundedStore) -> None:
        self._key = key
        self._store = store
        self._holder: str | None = None
        self._latest: IdempotencyRecord | None = None
        self._changed = asyncio.Event()
        self.users = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def changed(self, within: float) -> tuple[bool, IdempotencyRecord | None]:
        """Wait up to ``within`` seconds for the key to change hands; return whether it did
        and the record now under the key (``None`` when the key is free)."""
        event = self._changed
        try:
            async with asyncio.timeout(within):
                await event.wait()
        except TimeoutError:
            return False, None
        return True, self._latest

    async def _next_tick(self, delay: float) -> None:
        notifying = self._store.store
        if isinstance(notifying, ChangeNotifyingStore):
            try:
                async with asyncio.timeout(_MAX_POLL_SECONDS):
                    await notifying.wait_for_change(self._key)
            except TimeoutError:
                return
            except Exception as exc:  # notices are an optimisation: without them, poll
                logger.debug("no change notifications, polling: %s", error_summary(exc))
            else:
                return
        await asyncio.sleep(delay)

    async def _run(self) -> None:
        # The first look is at once: the first request may have finished between the
        # duplicate's acquire and this watch, and no notice would come for that.
        delay = _FIRST_POLL_SECONDS
        while True:
            try:
                record = await self._store.get(self._key)
            except StoreError as exc:
                logger.debug(
                    "a look at the key a duplicate waits for failed: %s", error_summary(exc)
                )
            else:
                self._look(record)
            await self._next_tick(delay)
            delay = min(delay * 2, _MAX_POLL_SECONDS)

    def _look(self, record: IdempotencyRecord | None) -> None:
        if self._holder is None and record is not None:
            self._holder = record.owner_token  # first look: the request being waited for
        if (
            record is None
            or record.status is not RecordStatus.IN_PROGRESS
            or record.owner_token != self._holder
        ):
            self._holder = record.owner_token if record else None
            self._latest = record
            self._changed.set()
            self._changed = asyncio.Event()

    def close(self) -> None:
        self._task.cancel()


class Waiters:
    """The waiting duplicates of one middleware instance, at most ``max_waiters`` at once."""

    def __init__(
        self,
        store: BoundedStore,
        max_waiters: int,
        observe: Callable[[int], None] = lambda delta: None,
    ) -> None:
        self._store = store
        self._max_waiters = max_waiters
        self._observe = observe
        self._count = 0
        self._watches: dict[str, KeyWatch] = {}

    @property
    def count(self) -> int:
        """How many requests wait now."""
        return self._count

    @contextlib.asynccontextmanager
    async def waiting(self, key: str) -> AsyncIterator[KeyWatch | None]:
        """A watch on ``key`` for one waiting request, or ``None`` when too many already wait."""
        if self._count >= self._max_waiters:
            yield None
            return
        watch = self._watches.get(key)
        if watch is None:
            watch = self._watches[key] = KeyWatch(key, self._store)
        self._count += 1
        self._observe(1)
        watch.users += 1
        try:
            yield watch
        finally:
            self._count -= 1
            self._observe(-1)
            watch.users -= 1
            if watch.users == 0:
                watch.close()
                del self._watches[key]
