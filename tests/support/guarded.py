"""An app behind the idempotency middleware, and an HTTP client that calls it in-process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from starlette_idempotency._endpoint import GUARD_SCOPE_KEY, GUARDED_SCOPE, PassedOn
from starlette_idempotency.testing import FakeClock
from tests.support.apps import Ledger, build_fastapi_app, build_starlette_app

#: The apps of :mod:`tests.support.apps` by kind: each serves the same guarded endpoints.
BUILDERS: dict[str, Callable[[Ledger], Any]] = {
    "fastapi": build_fastapi_app,
    "starlette": build_starlette_app,
}


@dataclass
class GuardedApp:
    """One of the :data:`BUILDERS` apps behind the middleware, with what a test reads or turns:
    the app's ledger, the middleware's store and fake clock, and a client to call it."""

    ledger: Ledger
    store: MemoryStore
    clock: FakeClock
    client: httpx.AsyncClient
    app: Any


def make_client(app: ASGIApp, *, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    """A client that calls ``app`` in-process. An exception in the app is raised in the test,
    as Starlette's ``TestClient`` and httpx's ``ASGITransport`` do, so a test fails with its
    cause; a test that wants the server's 500 instead passes ``raise_app_exceptions=False``."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


#: A guard's mark that lets an ``@idempotent`` endpoint run for any method.
_ANY_METHOD = PassedOn(frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}))


def unguarded(app: ASGIApp) -> ASGIApp:
    """``app`` as it behaves with no idempotency at all, to compare with: its ``@idempotent``
    endpoints hear from a guard that passed their requests on (as one passes a method it does
    not guard, for any method here), so they run instead of refusing an unguarded request."""

    async def without_guard(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope[GUARD_SCOPE_KEY] = _ANY_METHOD
        token = GUARDED_SCOPE.set(scope)
        try:
            await app(scope, receive, send)
        finally:
            GUARDED_SCOPE.reset(token)

    return without_guard


async def make_guarded_app(
    kind: str, store: MemoryStore | None = None, **options: Any
) -> GuardedApp:
    """The ``kind`` app behind the middleware (``options`` are the middleware's), on a
    :class:`FakeClock` that the store shares unless ``store`` is given."""
    ledger = Ledger()
    clock = FakeClock()
    store = MemoryStore(clock=clock) if store is None else store
    app = BUILDERS[kind](ledger)
    app.add_middleware(IdempotencyMiddleware, store=store, clock=clock, **options)
    return GuardedApp(ledger, store, clock, make_client(app), app)
