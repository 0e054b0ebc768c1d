"""The pure-ASGI middleware: what it guards, and what each guarded request is handed.

Non-HTTP scopes, other methods and undecorated routes pass straight through; a guarded
request becomes a :class:`~starlette_idempotency._request.GuardedRequest`, handed the
collaborators built here once (:class:`~starlette_idempotency._services.RequestServices`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Sequence
from typing import Any, Unpack

from starlette_idempotency._key_scope import KeyScope, KeyScopeResolver
from starlette_idempotency._loop_timers import PerLoop
from starlette_idempotency._openapi import OpenAPIDocumenter
from starlette_idempotency._options import (
    ROUTE_OPTIONS,
    IdempotencyPolicy,
    RouteOptions,
    check_option,
    unknown_option_error,
)
from starlette_idempotency._renewal import RENEWAL_RESOLUTION, Renewals
from starlette_idempotency._request import GuardedRequest
from starlette_idempotency._responses import ErrorFormat, ErrorResponder
from starlette_idempotency._routing import RouteResolver, routes_for
from starlette_idempotency._services import RequestLimits, RequestServices
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency._store_check import StartupCheck, StoreCheckPolicy
from starlette_idempotency._types import (
    DEFAULT_HEADER_NAME,
    ASGIApp,
    Clock,
    Receive,
    Scope,
    Send,
    system_clock,
)
from starlette_idempotency._waiting import Waiters
from starlette_idempotency._watchdog import LockWatchdog
from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.observability import (
    EventHook,
    KeyLogging,
    MetricsSink,
    Observer,
    StoreCallTracer,
)
from starlette_idempotency.stores.base import STORE_OPERATIONS, IdempotencyStore

logger = logging.getLogger(__name__)

__all__ = ["IdempotencyMiddleware", "KeyScope"]


@functools.cache
def _option_names() -> frozenset[str]:
    parameters = inspect.signature(IdempotencyMiddleware.__init__).parameters.values()
    return ROUTE_OPTIONS | {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}


@functools.cache
def _declared_option_types() -> dict[str, Any]:
    """The middleware's own options and their declared types (the route options are the
    policy's to check)."""
    hints = inspect.get_annotations(IdempotencyMiddleware.__init__, eval_str=True)
    return {name: hints[name] for name in _option_names() - ROUTE_OPTIONS if name in hints}


# An HTTP field name or method (RFC 9110 "token").
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _check_own_options(options: dict[str, Any]) -> None:
    """Refuse a middleware option given with a wrong type or value, naming it."""
    declared = _declared_option_types()
    for name, value in options.items():
        if name in declared:
            check_option(name, declared[name], value)
    for name in ("max_key_length", "max_waiters"):
        if options.get(name, 1) < 1:
            raise ConfigurationError(f"{name} must be at least 1, not {options[name]!r}")
    header_name = options.get("header_name", DEFAULT_HEADER_NAME)
    if not isinstance(header_name, str) or not _TOKEN.fullmatch(header_name):
        raise ConfigurationError(
            f"header_name must be an HTTP header name such as {DEFAULT_HEADER_NAME!r}, "
            f"not {header_name!r}"
        )
    methods = options.get("methods", ())
    if isinstance(methods, str | bytes) or not all(
        isinstance(method, str) and _TOKEN.fullmatch(method) for method in methods
    ):
        raise ConfigurationError(
            f"methods must be a list of HTTP methods such as ['POST', 'PATCH'], not {methods!r}"
        )
    if not isinstance(options.get("problem_type", ""), str):
        raise ConfigurationError(
            f"problem_type must be a URI string, not {options['problem_type']!r}"
        )


_CAPABILITIES = ("name", "supports_recovery", "never_blocks")


def _check_store_object(store: object) -> None:
    """Refuse, when the middleware is built, what is not a store instance."""
    if isinstance(store, type):
        raise ConfigurationError(
            f"store must be a store instance, not the class {store.__name__}: "
            f"pass {store.__name__}(...) (for example store=MemoryStore() or "
            "store=RedisStore.from_url('redis://localhost:6379/0'))"
        )
    if isinstance(store, str):
        raise ConfigurationError(
            f"store must be a store instance, not the string {store!r}: "
            f"pass store=RedisStore.from_url({store!r}) for Redis, or a PostgresStore "
            "connected in your lifespan (await PostgresStore.connect(dsn))"
        )
    if not isinstance(store, IdempotencyStore):
        missing = [
            name for name in STORE_OPERATIONS if not callable(getattr(store, name, None))
        ] + [name for name in _CAPABILITIES if not hasattr(store, name)]
        raise ConfigurationError(
            f"store must implement the IdempotencyStore protocol (MemoryStore, RedisStore, "
            f"PostgresStore, or your own subclass of starlette_idempotency.stores.StoreBase); "
            f"{type(store).__name__} lacks {', '.join(missing)}"
        )


def _compressing_layer_inside(app: ASGIApp) -> str | None:
    """The class name of a compressing middleware among the layers ``app`` wraps, if any."""
    layer: object = app
    for _ in range(64):  # a middleware stack, not a cycle
        name = type(layer).__name__
        if any(word in name.lower() for word in ("gzip", "brotli", "compress", "zstd")):
            return name
        layer = getattr(layer, "app", None)
        if layer is None:
            break
    return None


class IdempotencyMiddleware:
    """Makes decorated POST/PATCH routes safe to retry with an ``Idempotency-Key`` header.

    Every ``@idempotent`` option can be given here as the default for all routes; the
    documentation's options reference gives the meaning of each.
    """

    def __new__(cls, *args: Any, **options: Any) -> IdempotencyMiddleware:
        # Unknown options are refused here, before __init__, with a "did you mean": type
        # checkers still read __init__'s signature (and Starlette's add_middleware with it).
        known = _option_names()
        unknown = options.keys() - known
        if unknown:
            raise unknown_option_error(unknown, known, "IdempotencyMiddleware")
        _check_own_options(options)
        return super().__new__(cls)

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: IdempotencyStore,
        header_name: str = DEFAULT_HEADER_NAME,
        methods: Sequence[str] = ("POST", "PATCH"),
        max_key_length: int = 255,
        key_scope: KeyScope | None = None,
        protect_all: bool = False,
        error_format: ErrorFormat = "json",
        problem_type: str = "about:blank",
        max_body_bytes: int = 1024 * 1024,
        store_timeout_seconds: float = 1.0,
        max_waiters: int = 1000,
        pod_id: str | None = None,
        log_keys: KeyLogging = "raw",
        on_event: EventHook | None = None,
        metrics: MetricsSink | None = None,
        tracing: bool = False,
        check_store: StoreCheckPolicy = "warn",
        clock: Clock = system_clock,
        **route_defaults: Unpack[RouteOptions],
    ) -> None:
        _check_store_object(store)
        self.app = app
        self.store = store
        self.header_name = header_name
        self._methods = frozenset(method.upper() for method in methods)
        defaults = IdempotencyPolicy().merged(route_defaults)
        self._resolver = RouteResolver(defaults, protect_all=protect_all)
        errors = ErrorResponder(
            header_name=header_name, error_format=error_format, problem_type=problem_type
        )
        # Installed by the first scope, which names the app (there is none before: see _openapi)
        self._openapi: OpenAPIDocumenter | None = OpenAPIDocumenter(
            app,
            self._resolver,
            header_name=header_name,
            methods=self._methods,
            max_key_length=max_key_length,
            max_body_bytes=max_body_bytes,
            error_format=error_format,
            problem_type=problem_type,
        )
        self.observer = Observer(
            pod_id=pod_id, log_keys=log_keys, on_event=on_event, metrics=metrics
        )
        bounded = BoundedStore(
            store,
            timeout=store_timeout_seconds,
            metrics=metrics,
            tracer=StoreCallTracer() if tracing else None,
            clock=clock,
        )
        #: The duplicates waiting for a first request (``on_in_progress="wait"``).
        self.waiters = Waiters(bounded, max_waiters)
        #: Where running handlers wait for their first lock renewal (one timer per loop).
        self.renewal_timers = PerLoop(RENEWAL_RESOLUTION)
        #: What renews running handlers' locks while their event loop is blocked.
        self.watchdog = LockWatchdog(store, self.observer)
        self._services = RequestServices(
            app=app,
            limits=RequestLimits(
                header_name=header_name,
                header_bytes=header_name.lower().encode("latin-1"),
                max_key_length=max_key_length,
                max_body_bytes=max_body_bytes,
            ),
            clock=clock,
            errors=errors,
            observer=self.observer,
            store=bounded,
            key_scope=KeyScopeResolver(key_scope),
            waiters=self.waiters,
            renewals=Renewals(self.renewal_timers, self.watchdog),
        )
        self._startup_check = StartupCheck(store, check_store, self._check_routes)
        compressing = _compressing_layer_inside(app)
        if compressing is not None:
            logger.warning(
                "%s runs inside IdempotencyMiddleware, so responses are stored compressed for "
                "whatever encoding the first client accepted (a replay is decoded again for a "
                "client that does not accept it). Add IdempotencyMiddleware before %s "
                "(app.add_middleware(IdempotencyMiddleware, ...) first), so that it runs inside "
                "the compression and stores plain responses.",
                compressing,
                compressing,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._openapi is not None:  # the first scope: document its app, once
            openapi, self._openapi = self._openapi, None
            openapi.install(scope)
            if scope["type"] != "lifespan":
                # No lifespan ran to check the routes: log what it would have refused. A
                # misplaced decorator or a lock longer than the retention also fails its own
                # route's requests; a decorator on a route whose methods are not guarded
                # changes nothing.
                self._startup_check.route_problems(scope)
        if scope["type"] != "http" or scope["method"] not in self._methods:
            if scope["type"] == "lifespan":
                await self._startup_check.run(self.app, scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        route = self._resolver.resolve(scope, self.app)
        if route is None:
            await self.app(scope, receive, send)
            return
        await GuardedRequest(self._services, route, scope, receive, send).run()

    def _check_routes(self, scope: Scope) -> None:
        routes = routes_for(scope, self.app)
        if routes is not None:
            self._resolver.check(routes, self._methods)
