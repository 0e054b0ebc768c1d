"""Where the middleware's additions enter a FastAPI app's ``openapi()``: the app's own, once its
middleware stack is built, and FastAPI's class method before then.

Once the stack is built, the middleware's first scope calls :func:`install`, which puts a
wrapper in ``app.openapi`` around whatever was there (FastAPI's method or the user's own
override: composed, never replaced) and drops ``app.openapi_schema``, so that a schema an
earlier ``app.openapi()`` cached is built again. The wrapper completes each schema object the
inner function returns, once, copying what it changes.

Before the app has started, the middleware does not exist yet: Starlette builds the middleware
stack on the first ASGI call, and ``add_middleware`` only records the class and its options in
``app.user_middleware``. A script that exports the schema at import time
(``json.dumps(app.openapi())``, as client generators and CI contract checks do) reaches only
FastAPI's own ``openapi()``. So :func:`hook_fastapi` wraps ``fastapi.FastAPI.openapi`` once, at
the class level, when FastAPI is already imported (checked when the middleware's module is
imported and again by ``@idempotent``; the package never imports FastAPI itself). The wrapper
documents an app whose ``user_middleware`` holds a middleware given to
:func:`document_middleware`, with the documenter that class builds from the entry's options
(the innermost such entry, whose documenter the built stack's would be too), and leaves any
other app alone. Once the stack is built, the wrapper :func:`install` put in ``app.openapi``
(an instance attribute) wins: the class-level wrapper then returns FastAPI's own schema for it
to complete, so nothing is documented twice.

What the class-level wrapper cannot reach: an ``app.openapi`` override that builds its schema
with ``get_openapi()`` without calling ``FastAPI.openapi``, and an app that only uses
``protect_all`` when it imported ``IdempotencyMiddleware`` before FastAPI (no ``@idempotent``
runs to find FastAPI). Those are completed from the first scope on.

Why a module of its own: ``@idempotent`` calls :func:`hook_fastapi`, and the documenter's
module depends on the decorator's (through the route lookup).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from starlette.routing import BaseRoute

from starlette_idempotency._types import ASGIApp

if TYPE_CHECKING:
    from fastapi import FastAPI

Schema = dict[str, Any]


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


def install(app: FastAPI, documenter: SchemaDocumenter) -> None:
    """From now on, complete ``app.openapi()`` with ``documenter`` (the built stack's)."""
    current = app.openapi
    if isinstance(current, _DocumentedOpenAPI):  # a middleware stack built again
        current.use(documenter)
    else:
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
        """Complete schemas with ``documenter`` from now on (the middleware stack was built
        again, and its new middleware documents the app)."""
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


_DOCUMENTED_MIDDLEWARE: list[type[DocumentedMiddleware]] = []
_HOOKED = "__idempotency_documents__"
# Per app not started yet: the middleware entry its schema is documented for, and how.
_BEFORE_STARTUP: weakref.WeakKeyDictionary[Any, tuple[object, _DocumentedOpenAPI]] = (
    weakref.WeakKeyDictionary()
)


def document_middleware(middleware: type[DocumentedMiddleware]) -> None:
    """Have ``FastAPI.openapi`` document apps whose ``user_middleware`` holds ``middleware``
    (or a subclass) before their stack is built."""
    _DOCUMENTED_MIDDLEWARE.append(middleware)
    hook_fastapi()


def hook_fastapi() -> None:
    """Wrap ``fastapi.FastAPI.openapi`` once, if FastAPI is imported (see the module docs)."""
    fastapi = sys.modules.get("fastapi")
    application = getattr(fastapi, "FastAPI", None)
    if application is None or getattr(application.openapi, _HOOKED, False):
        return
    original: Callable[[FastAPI], dict[str, Any]] = application.openapi

    @functools.wraps(original)
    def openapi(self: FastAPI) -> dict[str, Any]:
        if isinstance(vars(self).get("openapi"), _DocumentedOpenAPI):
            return original(self)  # the built stack documents it
        entry = _innermost_entry(self)
        if entry is None:
            return original(self)
        known = _BEFORE_STARTUP.get(self)
        if known is None or known[0] is not entry:
            documenter = entry.cls.openapi_documenter(self.router, entry.kwargs)
            known = _BEFORE_STARTUP[self] = (
                entry,
                _DocumentedOpenAPI(self, functools.partial(original, self), documenter),
            )
        return known[1]()

    setattr(openapi, _HOOKED, True)
    application.openapi = openapi


def _innermost_entry(app: FastAPI) -> Any:
    """The innermost documented middleware among ``app.user_middleware``, if any."""
    found = None
    for entry in app.user_middleware:
        kind = entry.cls
        if isinstance(kind, type) and issubclass(kind, tuple(_DOCUMENTED_MIDDLEWARE)):
            found = entry
    return found
