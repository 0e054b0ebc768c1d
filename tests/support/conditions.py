"""Waiting for a condition: poll it until it holds, with a deadline, never a bare sleep.

:func:`eventually` is the one polling helper of the suite; :func:`eventually_sync` is its twin
for code that must block its thread (a sync fixture, or a test that must keep its event loop
from running while it waits). Both run on :class:`_Polling`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
DEFAULT_INTERVAL = 0.01


class _Polling:
    """The deadline and the failure shared by both helpers."""

    def __init__(self, timeout: float, interval: float, message: str) -> None:
        self.timeout = timeout
        self.interval = interval
        self.message = message
        self.deadline = time.monotonic() + timeout

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def failure(self) -> AssertionError:
        return AssertionError(f"timed out after {self.timeout}s waiting for {self.message}")

    def pause(self) -> float:
        """How long to sleep before the next try; raises :meth:`failure` once time is up."""
        remaining = self.remaining()
        if remaining <= 0:
            raise self.failure()
        return min(self.interval, remaining)


@overload
async def eventually(
    condition: Callable[[], Awaitable[T | None]],
    *,
    timeout: float = ...,  # noqa: ASYNC109 - a deadline for the polling, not for a call
    interval: float = ...,
    message: str = ...,
) -> T: ...


@overload
async def eventually(
    condition: Callable[[], T | None],
    *,
    timeout: float = ...,  # noqa: ASYNC109 - a deadline for the polling, not for a call
    interval: float = ...,
    message: str = ...,
) -> T: ...


async def eventually(
    condition: Callable[[], object],
    *,
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - a deadline for the polling, not for a call
    interval: float = DEFAULT_INTERVAL,
    message: str = "the condition",
) -> object:
    """Call ``condition`` (a function, or one returning an awaitable) every ``interval``
    seconds until it returns a true value, and return that value; fail the test (an
    ``AssertionError`` naming ``message``) after ``timeout`` seconds. An awaitable still
    pending at the deadline is cancelled."""
    polling = _Polling(timeout, interval, message)
    while True:
        outcome = condition()
        if inspect.isawaitable(outcome):
            try:
                async with asyncio.timeout(max(polling.remaining(), 0)) as bound:
                    outcome = await outcome
            except TimeoutError:
                if bound.expired():
                    raise polling.failure() from None
                raise
        if outcome:
            return outcome
        await asyncio.sleep(polling.pause())


def eventually_sync(
    condition: Callable[[], T | None],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = DEFAULT_INTERVAL,
    message: str = "the condition",
) -> T:
    """:func:`eventually` for a plain function, blocking the calling thread between tries."""
    polling = _Polling(timeout, interval, message)
    while not (outcome := condition()):
        time.sleep(polling.pause())
    return outcome
