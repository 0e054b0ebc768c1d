"""Helpers for testing apps that use starlette-idempotency (and for this project's own tests).

- :class:`FakeClock` drives :class:`~starlette_idempotency.MemoryStore` expiry without sleeping,
  and steps its wall clock alone to show that a clock step expires nothing.
- :class:`Executions` counts a handler's runs by idempotency key: ``assert_ran_once(key)``.
- :class:`FaultyStore` wraps a store and makes chosen operations fail or stall, to test what the
  app answers when its store is down or slow.
- :mod:`.pytest_plugin` (opt in with ``pytest_plugins``) has fixtures for a Redis, a PostgreSQL
  and a store on each (from an env URL, testcontainers or a throwaway local server).

What the plugin builds on (the server launchers, the isolation of tests) is private.
"""

from __future__ import annotations

from starlette_idempotency.testing.executions import Executions
from starlette_idempotency.testing.faults import FaultyStore, Stall


class FakeClock:
    """A settable clock: ``clock()`` returns the fake wall time in seconds since the epoch,
    ``clock.monotonic()`` the fake monotonic time that measures durations.

    :meth:`advance` lets time pass (both move); :meth:`jump` steps the wall clock alone, as
    an NTP correction or a resumed VM does, which must expire nothing.
    """

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start
        self._elapsed = 0.0

    def __call__(self) -> float:
        return self.now

    def monotonic(self) -> float:
        """Seconds that passed (by :meth:`advance`), from an arbitrary start."""
        return self._elapsed

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass: the wall clock and the monotonic clock both move."""
        self.now += seconds
        self._elapsed += seconds

    def jump(self, seconds: float) -> None:
        """Step the wall clock by ``seconds`` (either way) while no time passes."""
        self.now += seconds


__all__ = ["Executions", "FakeClock", "FaultyStore", "Stall"]
