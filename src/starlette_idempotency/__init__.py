"""Idempotency-Key middleware for Starlette and FastAPI.

Retried POST and PATCH requests with the same ``Idempotency-Key`` get the first response back
instead of running the handler again, across every process that shares the store.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from starlette_idempotency._context import IdempotencyContext, checkpoint, idempotency_context
from starlette_idempotency._decorator import idempotent
from starlette_idempotency._fingerprint import storage_key
from starlette_idempotency._marks import mark_retryable
from starlette_idempotency._record import StoredResponse
from starlette_idempotency._responses import IdempotencyProblem
from starlette_idempotency.errors import (
    ConfigurationError,
    IdempotencyError,
    LockLostError,
    StoreError,
    StoreTimeoutError,
    UnguardedRequestError,
)
from starlette_idempotency.middleware import IdempotencyMiddleware, KeyScope
from starlette_idempotency.observability import (
    CheckResult,
    EventHook,
    IdempotencyEvent,
    MetricsSink,
    OutcomeResult,
)
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.memory import MemoryStore

if TYPE_CHECKING:
    from starlette_idempotency.client import AsyncIdempotentTransport, IdempotentTransport
    from starlette_idempotency.prometheus import PrometheusMetrics
    from starlette_idempotency.stores.postgres import PostgresStore
    from starlette_idempotency.stores.redis import RedisStore

__version__ = "0.1.0"

# Parts with optional dependencies load on first use, so importing the package needs neither.
_LAZY = {
    "AsyncIdempotentTransport": "starlette_idempotency.client",
    "IdempotentTransport": "starlette_idempotency.client",
    "PrometheusMetrics": "starlette_idempotency.prometheus",
    "RedisStore": "starlette_idempotency.stores.redis",
    "PostgresStore": "starlette_idempotency.stores.postgres",
}
# What only a store implementer needs lives in starlette_idempotency.stores; 0.1 exported it
# here too, and these names still resolve, with a DeprecationWarning.
_MOVED = {
    "AcquireResult": "starlette_idempotency.stores",
    "Checkpoint": "starlette_idempotency.stores",
    "IdempotencyRecord": "starlette_idempotency.stores",
    "RecordStatus": "starlette_idempotency.stores",
    "IdempotencyPolicy": "starlette_idempotency.stores",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        module_name = _MOVED.get(name)
        if module_name is None:
            raise AttributeError(f"module 'starlette_idempotency' has no attribute {name!r}")
        warnings.warn(
            f"import {name} from starlette_idempotency.stores, not from the package root",
            DeprecationWarning,
            stacklevel=2,
        )
    return getattr(importlib.import_module(module_name), name)


__all__ = [
    "AsyncIdempotentTransport",
    "CheckResult",
    "ConfigurationError",
    "EventHook",
    "IdempotencyContext",
    "IdempotencyError",
    "IdempotencyEvent",
    "IdempotencyMiddleware",
    "IdempotencyProblem",
    "IdempotencyStore",
    "IdempotentTransport",
    "KeyScope",
    "LockLostError",
    "MemoryStore",
    "MetricsSink",
    "OutcomeResult",
    "PostgresStore",
    "PrometheusMetrics",
    "RedisStore",
    "StoreError",
    "StoreTimeoutError",
    "StoredResponse",
    "UnguardedRequestError",
    "__version__",
    "checkpoint",
    "idempotency_context",
    "idempotent",
    "mark_retryable",
    "storage_key",
]
