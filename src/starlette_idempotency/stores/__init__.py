"""What a store implementer needs: the protocol's base, its types and its capabilities.

The stores an application uses are exported from the package root (``MemoryStore``,
``RedisStore``, ``PostgresStore``), with the protocol ``IdempotencyStore`` and
``StoredResponse``; ``RedisStore`` lives in :mod:`.redis` and ``PostgresStore`` in
:mod:`.postgres` (each needs its extra).
"""

from __future__ import annotations

import typing as _typing

from starlette_idempotency._deprecation import moved as _moved
from starlette_idempotency._record import Checkpoint, IdempotencyRecord, RecordStatus
from starlette_idempotency.stores.base import (
    AcquireResult,
    ChangeNotifyingStore,
    CheckableStore,
    ConnectionOwningStore,
    FencedWrite,
    HeldRecord,
    StoreBase,
    StoreFinding,
)

# Each of these has one home elsewhere; the names exported here before still resolve.
_MOVED = {
    "IdempotencyPolicy": "starlette_idempotency.middleware",
    "IdempotencyStore": "starlette_idempotency",
    "MemoryStore": "starlette_idempotency",
    "StoredResponse": "starlette_idempotency",
}


def __getattr__(name: str) -> _typing.Any:
    if name in _MOVED:
        return _moved(name, __name__, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AcquireResult",
    "ChangeNotifyingStore",
    "CheckableStore",
    "Checkpoint",
    "ConnectionOwningStore",
    "FencedWrite",
    "HeldRecord",
    "IdempotencyRecord",
    "RecordStatus",
    "StoreBase",
    "StoreFinding",
]
