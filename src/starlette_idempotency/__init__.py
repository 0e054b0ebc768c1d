"""Idempotency-Key middleware for Starlette and FastAPI.

Retried POST and PATCH requests with the same ``Idempotency-Key`` get the first response back
instead of running the handler again, across every process that shares the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette_idempotency.context import IdempotencyContext, checkpoint, idempotency_context
from starlette_idempotency.errors import (
    ConfigurationError,
    IdempotencyError,
    LockLostError,
    StoreError,
    StoreTimeoutError,
)
from starlette_idempotency.fingerprint import storage_key
from starlette_idempotency.middleware import IdempotencyMiddleware, KeyScope
from starlette_idempotency.observability import (
    CheckResult,
    EventHook,
    IdempotencyEvent,
    MetricsSink,
    OutcomeResult,
)
from starlette_idempotency.policy import IdempotencyPolicy, idempotent, mark_retryable
from starlette_idempotency.record import (
    Checkpoint,
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
)
from starlette_idempotency.responses import IdempotencyProblem
from starlette_idempotency.stores.base import AcquireResult, IdempotencyStore
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


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'starlette_idempotency' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)


__all__ = [
    "AcquireResult",
    "AsyncIdempotentTransport",
    "CheckResult",
    "Checkpoint",
    "ConfigurationError",
    "EventHook",
    "IdempotencyContext",
    "IdempotencyError",
    "IdempotencyEvent",
    "IdempotencyMiddleware",
    "IdempotencyPolicy",
    "IdempotencyProblem",
    "IdempotencyRecord",
    "IdempotencyStore",
    "IdempotentTransport",
    "KeyScope",
    "LockLostError",
    "MemoryStore",
    "MetricsSink",
    "OutcomeResult",
    "PostgresStore",
    "PrometheusMetrics",
    "RecordStatus",
    "RedisStore",
    "StoreError",
    "StoreTimeoutError",
    "StoredResponse",
    "__version__",
    "checkpoint",
    "idempotency_context",
    "idempotent",
    "mark_retryable",
    "storage_key",
]
