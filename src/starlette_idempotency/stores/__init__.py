"""What a store implementer needs, all of it: the protocol and its base, the record and its
types, the results of the primitives, the capabilities a store may offer, and the errors a
store raises. A store module imports from here alone.

An application needs two of these names too, and the package root re-exports them:
``IdempotencyStore`` (to annotate the store it builds) and ``StoredResponse`` (to resolve a
key by hand). The errors live in :mod:`starlette_idempotency.errors` and the root; they are
here for the stores that raise them. The stores an application uses are exported from the
root (``MemoryStore``, ``RedisStore``, ``PostgresStore``); ``RedisStore`` lives in
:mod:`.redis` and ``PostgresStore`` in :mod:`.postgres` (each needs its extra).
"""

from __future__ import annotations

import typing as _typing

from starlette_idempotency._deprecation import moved as _moved
from starlette_idempotency._record import (
    Checkpoint,
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
)
from starlette_idempotency.errors import StoreError, StoreTimeoutError
from starlette_idempotency.stores.base import (
    AcquireResult,
    CallBatchingStore,
    ChangeNotifyingStore,
    CheckableStore,
    ConnectionOwningStore,
    FencedWrite,
    HeldRecord,
    IdempotencyStore,
    OperationClaimingStore,
    StoreBase,
    StoreFinding,
)

# Each of these has one home elsewhere; the names exported here before still resolve.
_MOVED = {
    "IdempotencyPolicy": "starlette_idempotency.middleware",
    "MemoryStore": "starlette_idempotency",
}


def __getattr__(name: str) -> _typing.Any:
    if name in _MOVED:
        return _moved(name, __name__, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AcquireResult",
    "CallBatchingStore",
    "ChangeNotifyingStore",
    "CheckableStore",
    "Checkpoint",
    "ConnectionOwningStore",
    "FencedWrite",
    "HeldRecord",
    "IdempotencyRecord",
    "IdempotencyStore",
    "OperationClaimingStore",
    "RecordStatus",
    "StoreBase",
    "StoreError",
    "StoreFinding",
    "StoreTimeoutError",
    "StoredResponse",
]
