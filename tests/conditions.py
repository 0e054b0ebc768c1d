"""Waiting on conditions in async tests: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(
    condition: Callable[[], bool], *, within: float = 5.0, what: str = "the condition"
) -> None:
    """Return once ``condition()`` is true; fail the test after ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while not condition():  # noqa: ASYNC110 - a plain predicate, no event to wait on
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {what}") from None


async def eventually_async(
    probe: Callable[[], Awaitable[bool]], *, within: float = 5.0, what: str = "the condition"
) -> None:
    """:func:`eventually` for a condition that needs an await to read (a store, a request)."""
    try:
        async with asyncio.timeout(within):
            while not await probe():  # noqa: ASYNC110 - polling a remote state, no event to wait on
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {what}") from None
