"""Idempotency-Key middleware for Starlette and FastAPI.

Retried POST and PATCH requests with the same ``Idempotency-Key`` get the first response back
instead of running the handler again, across every process that shares the store.

Every name loads on first use, so that ``import starlette_idempotency.client`` (httpx only)
loads no Starlette, and the stores and integrations load only their own driver.
"""

from __future__ import annotations

import typing as _typing
from importlib import import_module as _import_module
from importlib.util import find_spec as _find_spec

from starlette_idempotency._deprecation import moved as _moved

if _typing.TYPE_CHECKING:
    from starlette_idempotency._endpoint import (
        IdempotencyContext,
        checkpoint,
        idempotency_context,
        idempotent,
        mark_retryable,
    )
    from starlette_idempotency._kept_response import ResponseEncryption
    from starlette_idempotency._keys import KeySource, storage_key
    from starlette_idempotency._openapi.install import install_openapi
    from starlette_idempotency._responses import IdempotencyProblem
    from starlette_idempotency._transaction import IdempotencyTransaction, idempotency_transaction
    from starlette_idempotency.client import AsyncIdempotentTransport, IdempotentTransport
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
    from starlette_idempotency.prometheus import PrometheusMetrics
    from starlette_idempotency.readiness import (
        StoreReadiness,
        readiness_endpoint,
        readiness_route,
        store_ready,
    )
    from starlette_idempotency.stores import IdempotencyStore, StoredResponse
    from starlette_idempotency.stores.memory import MemoryStore
    from starlette_idempotency.stores.postgres import PostgresStore
    from starlette_idempotency.stores.redis import RedisStore

__version__ = "0.2.0"

# Where each name of __all__ is loaded from: the module that defines it, or for the two names
# an application shares with store implementers, starlette_idempotency.stores, their home.
_HOMES = {
    "AsyncIdempotentTransport": "starlette_idempotency.client",
    "CheckResult": "starlette_idempotency.observability",
    "ConfigurationError": "starlette_idempotency.errors",
    "EventHook": "starlette_idempotency.observability",
    "IdempotencyContext": "starlette_idempotency._endpoint",
    "IdempotencyError": "starlette_idempotency.errors",
    "IdempotencyEvent": "starlette_idempotency.observability",
    "IdempotencyMiddleware": "starlette_idempotency.middleware",
    "IdempotencyProblem": "starlette_idempotency._responses",
    "IdempotencyStore": "starlette_idempotency.stores",
    "IdempotencyTransaction": "starlette_idempotency._transaction",
    "IdempotentTransport": "starlette_idempotency.client",
    "KeyScope": "starlette_idempotency.middleware",
    "KeySource": "starlette_idempotency._keys",
    "LockLostError": "starlette_idempotency.errors",
    "MemoryStore": "starlette_idempotency.stores.memory",
    "MetricsSink": "starlette_idempotency.observability",
    "OutcomeResult": "starlette_idempotency.observability",
    "PostgresStore": "starlette_idempotency.stores.postgres",
    "PrometheusMetrics": "starlette_idempotency.prometheus",
    "RedisStore": "starlette_idempotency.stores.redis",
    "ResponseEncryption": "starlette_idempotency._kept_response",
    "StoreError": "starlette_idempotency.errors",
    "StoreReadiness": "starlette_idempotency.readiness",
    "StoreTimeoutError": "starlette_idempotency.errors",
    "StoredResponse": "starlette_idempotency.stores",
    "UnguardedRequestError": "starlette_idempotency.errors",
    "checkpoint": "starlette_idempotency._endpoint",
    "idempotency_context": "starlette_idempotency._endpoint",
    "idempotency_transaction": "starlette_idempotency._transaction",
    "idempotent": "starlette_idempotency._endpoint",
    "install_openapi": "starlette_idempotency._openapi.install",
    "mark_retryable": "starlette_idempotency._endpoint",
    "readiness_endpoint": "starlette_idempotency.readiness",
    "readiness_route": "starlette_idempotency.readiness",
    "storage_key": "starlette_idempotency._keys",
    "store_ready": "starlette_idempotency.readiness",
}
# What only a store implementer needs lives in starlette_idempotency.stores, and the route
# options in starlette_idempotency.middleware; 0.1 exported them here too.
_MOVED = {
    "AcquireResult": "starlette_idempotency.stores",
    "Checkpoint": "starlette_idempotency.stores",
    "IdempotencyRecord": "starlette_idempotency.stores",
    "RecordStatus": "starlette_idempotency.stores",
    "IdempotencyPolicy": "starlette_idempotency.middleware",
}


def __getattr__(name: str) -> _typing.Any:
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(_import_module(home), name)
        globals()[name] = value  # the next lookup is an ordinary one
        return value
    if name in _MOVED:
        return _moved(name, __name__, _MOVED[name])
    # A public submodule as an attribute of the root (``starlette_idempotency.errors``).
    if not name.startswith("_") and _find_spec(f"{__name__}.{name}"):
        return _import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


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
    "IdempotencyTransaction",
    "IdempotentTransport",
    "KeyScope",
    "KeySource",
    "LockLostError",
    "MemoryStore",
    "MetricsSink",
    "OutcomeResult",
    "PostgresStore",
    "PrometheusMetrics",
    "RedisStore",
    "ResponseEncryption",
    "StoreError",
    "StoreReadiness",
    "StoreTimeoutError",
    "StoredResponse",
    "UnguardedRequestError",
    "__version__",
    "checkpoint",
    "idempotency_context",
    "idempotency_transaction",
    "idempotent",
    "install_openapi",
    "mark_retryable",
    "readiness_endpoint",
    "readiness_route",
    "storage_key",
    "store_ready",
]
