"""A pool a store opens itself: on first use, in the running event loop, once.

A store built at import time (``PostgresStore.from_dsn``) exists before any event loop runs,
and an asyncpg pool works only in the loop that opened it. So the pool is opened by the first
operation that needs it (the middleware's startup check, in the server's loop), once however
many callers wait for it, and closed by :meth:`LazyPool.close`; that loop then gets no other
until :meth:`LazyPool.reopen` (the app starting again, in the same loop).

When the loop that closed its pool has ended, a later loop opens a new one: a test client runs
each start of the app in a loop of its own. A loop that ends with its pool still open (an app run
without its lifespan: Starlette's ``TestClient`` outside a ``with`` block runs each request in a
loop of its own) closes it as it shuts down (:func:`close_at_loop_end`), so the next loop opens
a new one too. A second loop is refused while the first is not closed, and so is a loop closed
with its pool still open (``loop.close()`` without ``loop.shutdown_asyncgens()``): a pool
serves only the loop that opened it, and can be closed from no other.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from starlette_idempotency.errors import ConfigurationError, StoreError


class _Closable(Protocol):
    async def close(self) -> None: ...


PoolT = TypeVar("PoolT", bound=_Closable)


def retrieve_exception(task: asyncio.Task[Any]) -> None:
    """A done callback for an opening nobody may await any more (its callers were cancelled):
    no "exception was never retrieved" in the logs, as its callers got their own errors."""
    if not task.cancelled():
        task.exception()


async def _until_loop_end(close: Callable[[], Awaitable[None]]) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await close()


async def close_at_loop_end(close: Callable[[], Awaitable[None]]) -> AsyncGenerator[None, None]:
    """Have the running event loop await ``close()`` as it shuts down, while connections
    opened in it can still be closed there; the caller keeps the returned generator (the
    loop holds it weakly) and ``aclose()``-s it when it closed them itself.

    ``asyncio.run``, ``asyncio.Runner`` and anyio (Starlette's ``TestClient``) close every
    async generator of a loop (``loop.shutdown_asyncgens()``) before closing the loop: a
    generator suspended here runs ``close`` then. A loop closed without that runs nothing.
    """
    guard = _until_loop_end(close)
    await anext(guard)
    return guard


def refuse_a_busy_loop(name: str, loop: asyncio.AbstractEventLoop, *, still_open: bool) -> None:
    """Refuse to use ``name`` in another event loop than ``loop``, the one its connections
    were opened in, unless ``loop`` is closed and they are not ``still_open``."""
    if not loop.is_closed():
        raise ConfigurationError(
            f"{name} belongs to another event loop, which is not closed: its connections "
            "serve only the loop that opened them. Use the store in one event loop (one "
            "per thread), or close it (await store.aclose()) in that loop first"
        )
    if still_open:
        raise ConfigurationError(
            f"{name} was opened in an event loop that ended without closing it "
            "(closed by loop.close() without loop.shutdown_asyncgens() first, which "
            "asyncio.run and anyio do): run the app with its lifespan, which closes the "
            "connections when the app stops, or await store.aclose() before the event loop ends"
        )


class LazyPool(Generic[PoolT]):
    """``open_pool()``'s pool, opened by the first :meth:`get` of an event loop; ``name``
    (``PostgresStore's pool``) is what its errors call it."""

    def __init__(self, open_pool: Callable[[], Awaitable[PoolT]], *, name: str) -> None:
        self._open_pool = open_pool
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: PoolT | None = None
        self._opening: asyncio.Task[PoolT] | None = None
        self._closed = False
        self._loop_end: AsyncGenerator[None, None] | None = None

    async def get(self) -> PoolT:
        """The pool, opened now if this loop has none yet.

        Concurrent first calls share one opening; one cut short by its caller's deadline
        leaves it to the others, and after a failed one the next call starts another.
        """
        loop = asyncio.get_running_loop()
        if loop is self._loop and self._pool is not None:
            return self._pool
        if loop is not self._loop:
            self._move_to(loop, closing=False)
        if self._closed:
            raise StoreError(self._closed_message())
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = loop.create_task(self._open())
            opening.add_done_callback(retrieve_exception)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and not (task is not None and task.cancelling()):
                # close() cut the opening short, not this caller's own cancellation
                raise StoreError(self._closed_message()) from None
            raise

    async def _open(self) -> PoolT:
        self._pool = pool = await self._open_pool()
        self._loop_end = await close_at_loop_end(functools.partial(self._close_at_loop_end, pool))
        return pool

    async def _close_at_loop_end(self, pool: PoolT) -> None:
        if self._pool is pool:  # not closed by close() meanwhile
            self._pool = self._loop_end = None
            await pool.close()

    async def close(self) -> None:
        """Close the pool (an opening under way is abandoned); this loop gets no other."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._move_to(loop, closing=True)
        self._closed = True
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done():
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
        pool, self._pool = self._pool, None
        loop_end, self._loop_end = self._loop_end, None
        if pool is not None:
            await pool.close()
        if loop_end is not None:
            await loop_end.aclose()

    def reopen(self) -> None:
        """Let a closed pool open again on first use (no-op while it is open)."""
        self._closed = False

    def _move_to(self, loop: asyncio.AbstractEventLoop, *, closing: bool) -> None:
        """Make ``loop`` the pool's loop, if the loop it had is done with it."""
        if self._loop is not None:
            refuse_a_busy_loop(
                self._name, self._loop, still_open=self._pool is not None and not closing
            )
        self._loop, self._pool, self._opening, self._closed = loop, None, None, False
        self._loop_end = None

    def _closed_message(self) -> str:
        return (
            f"{self._name} is closed (by aclose(), which the middleware calls when the app's "
            "lifespan ends): no new one is opened in this event loop until the app starts again"
        )
