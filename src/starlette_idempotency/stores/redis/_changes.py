"""Change notices for waiting duplicates over Redis pub/sub.

The complete, fail and release scripts ``PUBLISH`` on a channel named after the storage key.
Each :class:`~starlette_idempotency.stores.redis.RedisStore` keeps one subscriber connection
(its driver's :class:`~starlette_idempotency.stores.redis._driver.Subscription`), shared by
every waiter of its process; a channel is subscribed while someone waits on it, and
unsubscribed a few seconds after the last waiter left, so a waiter's repeated waits do not
cost a SUBSCRIBE each. Keyspace notifications are not used: they are off by default and
node-local in a cluster, while a published message reaches subscribers on every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores.redis._driver import Subscription

logger = logging.getLogger(__name__)

_LINGER_SECONDS = 5.0


class RedisChangeListener:
    """One pub/sub connection; waiters block in :meth:`wait` until their channel gets a notice."""

    def __init__(self, open_subscription: Callable[[], Subscription]) -> None:
        self._open_subscription = open_subscription
        self._pubsub: Subscription | None = None
        self._reader: asyncio.Task[None] | None = None
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: Counter[str] = Counter()
        self._subscribed: set[str] = set()
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        # One SUBSCRIBE at a time: redis-py's PubSub opens its connection on first use without
        # a lock (5.0 at least), so concurrent first subscribes each open, and leak, their own.
        self._subscribing = asyncio.Lock()

    async def wait(self, channel: str) -> None:
        """Return once a notice arrives on ``channel`` (or the connection broke)."""
        self._waiters[channel] += 1
        try:
            timer = self._lingering.pop(channel, None)
            if timer is not None:
                timer.cancel()
            event = self._events.setdefault(channel, asyncio.Event())
            await self._subscribe(channel)
            await event.wait()
        finally:
            self._waiters[channel] -= 1
            if not self._waiters[channel]:
                del self._waiters[channel]
                self._lingering[channel] = asyncio.get_running_loop().call_later(
                    _LINGER_SECONDS, self._unsubscribe_later, channel
                )

    async def _subscribe(self, channel: str) -> None:
        if channel in self._subscribed:
            return
        async with self._subscribing:
            if channel in self._subscribed:
                return
            try:
                if self._pubsub is None:
                    self._pubsub = self._open_subscription()
                await self._pubsub.subscribe(channel)
            except Exception as exc:
                raise StoreError(f"redis SUBSCRIBE {channel!r} failed: {exc}") from exc
            self._subscribed.add(channel)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())

    def _unsubscribe_later(self, channel: str) -> None:
        self._lingering.pop(channel, None)
        self._events.pop(channel, None)
        if channel in self._subscribed and self._pubsub is not None:
            self._subscribed.discard(channel)
            asyncio.get_running_loop().create_task(self._unsubscribe(channel))

    async def _unsubscribe(self, channel: str) -> None:
        with contextlib.suppress(Exception):
            if self._pubsub is not None:
                await self._pubsub.unsubscribe(channel)

    async def _read(self) -> None:
        try:
            while self._pubsub is not None:
                channel = await self._pubsub.next_channel()
                if channel is None:
                    continue
                event = self._events.pop(channel, None)
                if event is not None:
                    event.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("redis change notices stopped, waiters fall back to polling: %s", exc)
            await self._reset()

    async def _reset(self) -> None:
        """Drop the broken connection and wake every waiter (they read the key again)."""
        pubsub, self._pubsub, self._reader = self._pubsub, None, None
        self._subscribed.clear()
        for event in self._events.values():
            event.set()
        self._events.clear()
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def aclose(self) -> None:
        """Close the connection; a later :meth:`wait` opens another, in its own event loop."""
        self._subscribing = asyncio.Lock()  # one waited on is bound to its event loop
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._reset()
