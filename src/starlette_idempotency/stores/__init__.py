"""Store backends and the protocol they implement."""

from __future__ import annotations

from starlette_idempotency.stores.base import AcquireResult, IdempotencyStore
from starlette_idempotency.stores.memory import MemoryStore

__all__ = ["AcquireResult", "IdempotencyStore", "MemoryStore"]
