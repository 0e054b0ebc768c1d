"""What every guarded request is handed: collaborators built once per middleware.

A request touches the middleware through these and nothing else, so the engine below the
middleware never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette_idempotency._kept_response import ResponseKeeper
from starlette_idempotency._keys import KeyScopeResolver
from starlette_idempotency._renewal import LockRenewals
from starlette_idempotency._responses import ErrorResponder
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency._types import ASGIApp, Clock
from starlette_idempotency._waiting import Waiters
from starlette_idempotency.observability import Observer


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The middleware-wide limits on a guarded request's key and body."""

    header_name: str
    #: ``header_name`` as it appears in ASGI headers (lower-case bytes).
    header_bytes: bytes
    max_key_length: int
    max_body_bytes: int


@dataclass(frozen=True, slots=True)
class RequestServices:
    """The collaborators a :class:`~starlette_idempotency._request.GuardedRequest` uses."""

    #: The app the middleware wraps: what a guarded request runs.
    app: ASGIApp
    limits: RequestLimits
    clock: Clock
    errors: ErrorResponder
    #: What a finished response leaves in the store, and how a replay reads it back.
    responses: ResponseKeeper
    observer: Observer
    store: BoundedStore
    key_scope: KeyScopeResolver
    waiters: Waiters
    #: Where running handlers' locks are renewed: one timer per loop.
    renewals: LockRenewals
