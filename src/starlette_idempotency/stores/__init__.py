"""Store backends, and what a store implementer needs: the protocol, its base and its types
(and :class:`IdempotencyPolicy`, the merged options of a route, for tools that inspect them).

``RedisStore`` lives in :mod:`.redis` and ``PostgresStore`` in :mod:`.postgres` (each needs its
extra); both are also exported, lazily, from the package root.
"""

from __future__ import annotations

from starlette_idempotency._options import IdempotencyPolicy
from starlette_idempotency._record import (
    Checkpoint,
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
)
from starlette_idempotency.stores.base import (
    AcquireResult,
    ChangeNotifyingStore,
    CheckableStore,
    FencedWrite,
    IdempotencyStore,
    StoreBase,
    StoreFinding,
    WatchdogStore,
)
from starlette_idempotency.stores.memory import MemoryStore

__all__ = [
    "AcquireResult",
    "ChangeNotifyingStore",
    "CheckableStore",
    "Checkpoint",
    "FencedWrite",
    "IdempotencyPolicy",
    "IdempotencyRecord",
    "IdempotencyStore",
    "MemoryStore",
    "RecordStatus",
    "StoreBase",
    "StoreFinding",
    "StoredResponse",
    "WatchdogStore",
]
