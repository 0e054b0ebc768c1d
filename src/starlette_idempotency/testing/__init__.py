"""Helpers for testing apps that use starlette-idempotency (and for this project's own tests).

``FakeClock`` drives :class:`~starlette_idempotency.MemoryStore` expiry without sleeping. The
``servers`` submodules start throwaway Redis and PostgreSQL servers from local binaries.
"""

from __future__ import annotations


class FakeClock:
    """A settable clock: ``clock()`` returns the current fake time in seconds."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


__all__ = ["FakeClock"]
