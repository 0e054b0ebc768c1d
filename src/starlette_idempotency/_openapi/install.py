"""Where the middleware's additions enter a FastAPI app's ``openapi()``: always the app's own
``app.openapi`` (an instance attribute, as FastAPI's docs have users override it), never
FastAPI's class.

Once the middleware stack is built, the middleware's first scope calls :func:`install`, which
puts a wrapper in ``app.openapi`` around whatever was there (FastAPI's method or the user's
own override: composed, never replaced) and drops ``app.openapi_schema``, so that a schema an
earlier ``app.openapi()`` cached is built again. The wrapper completes each schema object the
inner function returns, once, copying what it changes.

Before the app has started, the middleware does not exist yet: Starlette builds the middleware
stack on the first ASGI call, and ``add_middleware`` only records the class and its options in
``app.user_middleware``, with no hook for anyone to run. A script that exports the schema
without starting the app (``json.dumps(app.openapi())``, as client generators and CI contract
checks do) therefore calls :func:`install_openapi` first, as ``add_pagination(app)`` is called
for fastapi-pagination: it installs the documenter that the innermost middleware entry's class
builds from the entry's options, and the built stack's middleware replaces it (``use``) at its
first scope, so nothing is documented twice.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from starlette.routing import BaseRoute

from starlette_idempotency._openapi.fragments import Schema
from starlette_idempotency._types import ASGIApp
from starlette_idempotency.errors import ConfigurationError

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger(__name__)


class SchemaDocumenter(Protocol):
    """Completes a schema with what one middleware does."""

    def document(self, schema: Mapping[str, Any], routes: Iterable[BaseRoute]) -> Schema:
        """``schema`` with the guarded operations among ``routes`` documented."""
        ...


class DocumentedMiddleware(Protocol):
    """A middleware class that documents a FastAPI app before its stack is built."""

    @classmethod
    def openapi_documenter(cls, app: ASGIApp, options: Mapping[str, Any]) -> SchemaDocumenter:
        """The documenter a middleware built with ``options`` around ``app`` would install."""
        ...


def fastapi_app(candidate: object) -> FastAPI | None:
    """``candidate`` when it is a FastAPI app."""
    # Never imported here: FastAPI is optional, and an app that is one has imported it.
    fastapi = sys.modules.get("fastapi")
    if fastapi is not None and isinstance(candidate, fastapi.FastAPI):
        return cast("FastAPI", candidate)
    return None


def install_openapi(app: FastAPI) -> None:
    """Complete ``app.openapi()`` with what the app's ``IdempotencyMiddleware`` does (the key
    header, the middleware's answers, the replay headers), before the app has started.

    Call it once, after ``app.add_middleware(IdempotencyMiddleware, ...)`` and after setting
    your own ``app.openapi`` override, if any. The served ``/openapi.json`` needs no call: the
    middleware documents its app when it sees its first request or the lifespan. A script that
    exports ``app.openapi()`` without starting the app needs it; without it, that schema lacks
    what the middleware adds.

    Raises :class:`~starlette_idempotency.ConfigurationError` when ``app`` is not a FastAPI
    app, when it has no ``IdempotencyMiddleware`` yet, or when the middleware's options are
    wrong (as its startup would).
    """
    documented = fastapi_app(app)
    if documented is None:
        raise ConfigurationError(
            f"install_openapi(app) documents a FastAPI app's openapi(), not a "
            f"{type(app).__name__}: a Starlette app has no OpenAPI schema"
        )
    if documented.middleware_stack is not None and isinstance(
        documented.openapi, _DocumentedOpenAPI
    ):
        return  # started: its middleware documents it already
    entry = None
    for candidate in documented.user_middleware:  # outermost first: the innermost decides
        kind = candidate.cls
        if isinstance(kind, type) and callable(getattr(kind, "openapi_documenter", None)):
            entry = candidate
    if entry is None:
        raise ConfigurationError(
            "install_openapi(app) found no IdempotencyMiddleware in the app: call it after "
            "app.add_middleware(IdempotencyMiddleware, store=...)"
        )
    middleware = cast("type[DocumentedMiddleware]", entry.cls)
    install(documented, middleware.openapi_documenter(documented.router, entry.kwargs))


def install(app: FastAPI, documenter: SchemaDocumenter) -> None:
    """From now on, complete ``app.openapi()`` with ``documenter``."""
    current = app.openapi
    if isinstance(current, _DocumentedOpenAPI):  # install_openapi, or a stack built again
        current.use(documenter)
    else:
        if app.openapi_schema is not None and app.middleware_stack is not None:
            # Started (the first scope installs), with a schema cached before: exported bare.
            logger.warning(
                "app.openapi() was called before the app started, and the schema it returned "
                "lacks what IdempotencyMiddleware adds (the key header, its answers). A script "
                "that exports the schema before startup must call "
                "starlette_idempotency.install_openapi(app) after app.add_middleware(...)."
            )
        app.openapi = _DocumentedOpenAPI(app, current, documenter)  # type: ignore[method-assign]
    app.openapi_schema = None


class _DocumentedOpenAPI:
    """``app.openapi`` as it was, its schema completed by a :class:`SchemaDocumenter`."""

    def __init__(
        self, app: FastAPI, inner: Callable[[], dict[str, Any]], documenter: SchemaDocumenter
    ) -> None:
        self._app = app
        self._inner = inner
        self._documenter = documenter
        self._source: object = None
        self._documented: Schema = {}

    def use(self, documenter: SchemaDocumenter) -> None:
        """Complete schemas with ``documenter`` from now on (the built middleware's, or
        :func:`install_openapi` called again)."""
        self._documenter = documenter
        self._source = None

    def __call__(self) -> dict[str, Any]:
        schema = self._inner()
        if schema is self._documented:  # an override returned the app.openapi_schema we set
            return schema
        if schema is not self._source:
            self._documented = self._documenter.document(schema, self._app.routes)
            self._source = schema
        # FastAPI's own openapi() and the documented overrides return the cached schema
        self._app.openapi_schema = self._documented
        return self._documented
