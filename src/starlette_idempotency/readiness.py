"""Readiness of the idempotency store, for a Kubernetes readiness probe.

Under ``check_store="warn"`` (the default) an app whose store is unreachable still starts, and
then answers every guarded request 503. A readiness probe on :func:`readiness_route` keeps such
a pod out of the Service's endpoints until its store works, without refusing the startup: the
same check the middleware runs at startup (and ``starlette-idempotency doctor`` from a shell),
run again on every probe. Starlette::

    app = Starlette(routes=[..., readiness_route(store)])

FastAPI (the route stays out of the OpenAPI schema)::

    app.router.routes.append(readiness_route(store))
    # or, as a path operation: app.add_api_route("/ready", readiness_endpoint(store),
    #                                             include_in_schema=False)

The answer is ``200 {"status": "ready", ...}``, or ``503 {"status": "not_ready", "errors":
[...]}`` naming what is wrong (the store's address, never its password). Warnings (a Redis that
can evict records, a table that is ``UNLOGGED``) are listed but leave the pod ready: the store
works, with weaker guarantees.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from starlette_idempotency._store_check import check_store
from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.stores.base import CheckableStore

#: How long a probe waits for the store by default: below the timeoutSeconds a probe should
#: have (the example manifest sets 3), so that the answer names the cause.
DEFAULT_READINESS_TIMEOUT = 2.0

ReadinessEndpoint = Callable[[Request], Awaitable[JSONResponse]]
"""What :func:`readiness_endpoint` returns: an endpoint for ``Route`` or ``add_api_route``."""


@dataclass(frozen=True, slots=True)
class StoreReadiness:
    """What :func:`store_ready` found: ``ready`` unless the store reported an ``error``."""

    ready: bool
    #: Where the store is (``redis at 127.0.0.1:6379/0``), or its type for a store that cannot
    #: say.
    store: str
    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ready

    def as_dict(self) -> dict[str, Any]:
        """The JSON body of the readiness route."""
        body: dict[str, Any] = {"status": "ready" if self.ready else "not_ready"}
        body["store"] = self.store
        if self.errors:
            body["errors"] = list(self.errors)
        body["warnings"] = list(self.warnings)
        return body


async def store_ready(
    store: object,
    *,
    timeout: float = DEFAULT_READINESS_TIMEOUT,  # noqa: ASYNC109 - no answer is "not ready"
) -> StoreReadiness:
    """Check ``store`` as the middleware does at startup: ready unless it is unreachable,
    answers nothing within ``timeout`` seconds, or cannot work as it is (a missing PostgreSQL
    table, a read-only database, a store without its pool). Never raises for the store's sake.

    A store that cannot check itself (``MemoryStore``, a custom store without ``check``) is
    always ready."""
    where = store.describe() if isinstance(store, CheckableStore) else type(store).__name__
    try:
        findings = await check_store(store, timeout)
    except ConfigurationError as exc:
        return StoreReadiness(False, where, errors=(" ".join(str(exc).split()),))
    errors = tuple(finding.message for finding in findings if finding.level == "error")
    warnings = tuple(finding.message for finding in findings if finding.level == "warning")
    return StoreReadiness(not errors, where, errors, warnings)


def readiness_endpoint(
    store: object, *, timeout: float = DEFAULT_READINESS_TIMEOUT
) -> ReadinessEndpoint:
    """An endpoint answering ``200`` when :func:`store_ready` says ready, ``503`` otherwise,
    with :meth:`StoreReadiness.as_dict` as its JSON body (never cached)."""

    async def ready(request: Request) -> JSONResponse:
        readiness = await store_ready(store, timeout=timeout)
        return JSONResponse(
            readiness.as_dict(),
            status_code=200 if readiness.ready else 503,
            headers={"cache-control": "no-store"},
        )

    return ready


def readiness_route(
    store: object, path: str = "/ready", *, timeout: float = DEFAULT_READINESS_TIMEOUT
) -> Route:
    """A ``GET`` (and ``HEAD``) route at ``path`` serving :func:`readiness_endpoint`, named
    ``idempotency_readiness`` and left out of FastAPI's OpenAPI schema."""
    return Route(
        path,
        readiness_endpoint(store, timeout=timeout),
        methods=["GET"],
        name="idempotency_readiness",
        include_in_schema=False,
    )
