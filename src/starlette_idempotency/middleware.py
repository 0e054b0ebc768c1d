"""The pure-ASGI middleware: what it guards, and what each guarded request is handed.

Non-HTTP scopes, other methods and undecorated routes pass straight through; a guarded
request becomes a :class:`~starlette_idempotency._request.GuardedRequest`, handed the
collaborators built here once (:class:`~starlette_idempotency._services.RequestServices`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Unpack, cast

from starlette.middleware.exceptions import ExceptionMiddleware

from starlette_idempotency._claims import ServedOperation, claimable, code_name
from starlette_idempotency._endpoint import (
    GUARD_RUN,
    GUARD_SCOPE_KEY,
    GUARDED_SCOPE,
    METHOD_NOT_GUARDED,
    REQUEST_SCOPE_KEY,
    RUN_SCOPE_KEY,
    GuardRun,
)
from starlette_idempotency._kept_response import ResponseEncryption, ResponseKeeper
from starlette_idempotency._keys import KeyScope, KeyScopeResolver
from starlette_idempotency._openapi.documenter import OpenAPIDocumenter
from starlette_idempotency._options import (
    ROUTE_OPTIONS,
    IdempotencyPolicy,
    RouteOptions,
    check_option,
    unknown_option_error,
)
from starlette_idempotency._renewal import LockRenewals
from starlette_idempotency._request import GuardedRequest
from starlette_idempotency._responses import ErrorFormat, ErrorResponder, Problem
from starlette_idempotency._routing import (
    RouteResolver,
    iter_routes,
    mounted_apps,
    operation_of,
    routes_for,
)
from starlette_idempotency._services import RequestLimits, RequestServices
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency._store_check import StartupCheck, StoreCheckPolicy, refuse_startup
from starlette_idempotency._types import (
    DEFAULT_HEADER_NAME,
    HTTP_TOKEN,
    REPLAY_HEADER,
    ASGIApp,
    Clock,
    Receive,
    Scope,
    Send,
    checked_header_name,
    system_clock,
)
from starlette_idempotency._waiting import Waiters
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

__all__ = ["IdempotencyMiddleware", "IdempotencyPolicy", "KeyScope"]


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


def _check_own_options(options: Mapping[str, Any]) -> None:
    """Refuse a middleware option given with a wrong type or value, naming it."""
    declared = _declared_option_types()
    for name, value in options.items():
        if name in declared:
            check_option(name, declared[name], value)
    for name in ("max_key_length", "max_waiters"):
        if options.get(name, 1) < 1:
            raise ConfigurationError(f"{name} must be at least 1, not {options[name]!r}")
    for option, example in (
        ("header_name", DEFAULT_HEADER_NAME),
        ("replay_header_name", REPLAY_HEADER),
    ):
        checked_header_name(option, options.get(option, example), example)
    methods = options.get("methods", ())
    if isinstance(methods, str | bytes) or not all(
        isinstance(method, str) and HTTP_TOKEN.fullmatch(method) for method in methods
    ):
        raise ConfigurationError(
            f"methods must be a list of HTTP methods such as ['POST', 'PATCH'], not {methods!r}"
        )
    encryption = options.get("encryption")
    if encryption is not None and not isinstance(encryption, ResponseEncryption):
        raise ConfigurationError(
            "encryption must be a ResponseEncryption({key_id: key}, current=key_id) or None, "
            f"not {type(encryption).__name__}"
        )
    if not isinstance(options.get("problem_type", ""), str):
        raise ConfigurationError(
            f"problem_type must be a URI string, not {options['problem_type']!r}"
        )


def _check_options(options: Mapping[str, Any]) -> None:
    """Refuse, naming it, any option the middleware would not work with."""
    known = _option_names()
    unknown = options.keys() - known
    if unknown:  # with a "did you mean"
        raise unknown_option_error(unknown, known, "IdempotencyMiddleware")
    _check_own_options(options)
    if "store" not in options:
        raise ConfigurationError(
            "IdempotencyMiddleware needs a store: add store=MemoryStore(), "
            "store=RedisStore.from_url(url) or store=PostgresStore.from_dsn(dsn)"
        )
    _check_store_object(options["store"])
    IdempotencyPolicy().merged({name: options[name] for name in ROUTE_OPTIONS & options.keys()})
    ErrorResponder(
        header_name=options.get("header_name", DEFAULT_HEADER_NAME),
        error_format=options.get("error_format", "json"),
        problem_type=options.get("problem_type", "about:blank"),
    )


def _in_an_app_stack(app: object) -> bool:
    """Whether ``app`` is a layer of a Starlette (or FastAPI) app's own middleware stack, which
    ``build_middleware_stack`` builds around the app's ``ExceptionMiddleware``, always the
    innermost (a layer in between that keeps its app elsewhere than ``.app`` hides it)."""
    layer: object = app
    for _ in range(64):  # a middleware stack, not a cycle
        if isinstance(layer, ExceptionMiddleware):
            return True
        layer = getattr(layer, "app", None)
        if layer is None:
            break
    return False


_M = TypeVar("_M")


class _CheckedFirst(type):
    """Builds ``IdempotencyMiddleware(app, **options)`` once its options are checked.

    Called with wrong options, it raises :class:`ConfigurationError`, except where the
    exception would not stop the server: Starlette builds an app's middleware stack on the
    app's first ASGI call, the lifespan's, and uvicorn reads an exception there as "no
    lifespan", reports a healthy start and answers every request 500. So a middleware built
    into an app's stack from wrong options is built refusing: it fails the lifespan startup
    (the server exits with the message) and raises the error for every request. The checks
    run before ``__init__``, whose signature type checkers (and ``add_middleware`` with them)
    read, so that no option it would not bind (a missing ``store``) escapes them.
    """

    def __call__(cls: type[_M], app: ASGIApp, *args: Any, **options: Any) -> _M:
        try:
            if args:
                raise ConfigurationError(
                    "IdempotencyMiddleware takes its options by name (store=..., "
                    f"header_name=...), not {len(args)} positional argument(s)"
                )
            _check_options(options)
        except ConfigurationError as exc:
            if not _in_an_app_stack(app):
                raise
            refused: Any = cls.__new__(cls)  # no __init__: nothing but the refusal runs
            refused.app, refused._refusal = app, exc
            return cast(_M, refused)
        return cast(_M, super().__call__(app, **options))  # type: ignore[misc]


def _route_resolver(route_defaults: Mapping[str, Any], *, protect_all: bool) -> RouteResolver:
    """The middleware's route lookup: its route options are every route's defaults."""
    return RouteResolver(IdempotencyPolicy().merged(route_defaults), protect_all=protect_all)


def _mounted_problems(routes: Sequence[Any]) -> list[str]:
    """What the ``IdempotencyMiddleware`` of each app mounted below ``routes`` would refuse at
    its own startup, which Starlette never sends it: its options, and its routes."""
    problems = []
    for path, app in mounted_apps(routes):
        for spec in getattr(app, "user_middleware", ()):
            cls = getattr(spec, "cls", None)
            if not (isinstance(cls, type) and issubclass(cls, IdempotencyMiddleware)):
                continue
            try:
                _check_options(spec.kwargs)
                values = inspect.signature(cls.__init__).bind(None, app, **spec.kwargs)
                values.apply_defaults()
                options = values.arguments
                resolver = _route_resolver(
                    options["route_defaults"], protect_all=options["protect_all"]
                )
                # An app with middleware of its own to build is a Starlette app, with routes.
                methods = frozenset(method.upper() for method in options["methods"])
                resolver.check(getattr(app, "routes", ()), methods)
            except ConfigurationError as exc:
                problems.append(f"the IdempotencyMiddleware of the app mounted at {path}: {exc}")
    return problems


_CAPABILITIES = ("name", "supports_recovery")


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
            f"pass store=RedisStore.from_url({store!r}) for Redis, or "
            "store=PostgresStore.from_dsn(dsn) for PostgreSQL"
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


#: What GUARDED_SCOPE holds outside any guard's request.
_NO_SCOPE: Scope = {}


class IdempotencyMiddleware(metaclass=_CheckedFirst):
    """Makes decorated POST/PATCH routes safe to retry with an ``Idempotency-Key`` header.

    Every ``@idempotent`` option can be given here as the default for all routes; the
    documentation's options reference gives the meaning of each.
    """

    #: Why this middleware refuses the startup and every request: Starlette built it into an
    #: app's stack from wrong options (see ``_CheckedFirst``), or the first request of an app
    #: whose lifespan did not run found a decorated handler its routes would run unguarded
    #: (see :meth:`_unguarded_methods`).
    _refusal: ConfigurationError | None = None

    @classmethod
    def openapi_documenter(cls, app: ASGIApp, options: Mapping[str, Any]) -> OpenAPIDocumenter:
        """What a middleware built around ``app`` with ``options`` adds to the OpenAPI schema,
        for an app whose middleware stack is not built yet (see ``install_openapi``)."""
        _check_options(options)
        bound = inspect.signature(cls.__init__).bind(None, app, **options)
        bound.apply_defaults()
        values = bound.arguments
        documented = inspect.signature(OpenAPIDocumenter).parameters.values()
        return OpenAPIDocumenter(
            app,
            _route_resolver(values["route_defaults"], protect_all=values["protect_all"]),
            **{p.name: values[p.name] for p in documented if p.kind is p.KEYWORD_ONLY},
        )

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
        replay_header_name: str = REPLAY_HEADER,
        encryption: ResponseEncryption | None = None,
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
        self.app = app
        self.store = store
        self.header_name = header_name
        self._methods = frozenset(method.upper() for method in methods)
        self._resolver = _route_resolver(route_defaults, protect_all=protect_all)
        errors = ErrorResponder(
            header_name=header_name, error_format=error_format, problem_type=problem_type
        )
        # Installed by the first scope, which names the app (none before: see install_openapi)
        self._openapi: OpenAPIDocumenter | None = OpenAPIDocumenter(
            app,
            self._resolver,
            header_name=header_name,
            methods=self._methods,
            max_key_length=max_key_length,
            max_body_bytes=max_body_bytes,
            error_format=error_format,
            problem_type=problem_type,
            replay_header_name=replay_header_name,
            encryption=encryption,
        )
        self.observer = Observer(
            pod_id=pod_id, log_keys=log_keys, on_event=on_event, metrics=metrics
        )
        bounded = BoundedStore(
            store,
            timeout=store_timeout_seconds,
            metrics=self.observer.metrics,
            tracer=StoreCallTracer() if tracing else None,
            clock=clock,
        )
        #: The duplicates waiting for a first request (``on_in_progress="wait"``).
        self.waiters = Waiters(bounded, max_waiters, self.observer.waiting)
        #: What keeps running handlers' locks: their loops' timers.
        self.renewals = LockRenewals(self.observer)
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
            responses=ResponseKeeper(replay_header_name=replay_header_name, encryption=encryption),
            observer=self.observer,
            store=bounded,
            key_scope=KeyScopeResolver(key_scope),
            waiters=self.waiters,
            renewals=self.renewals,
        )
        self._startup_check = StartupCheck(
            store,
            check_store,
            self._check_routes,
            timeout=store_timeout_seconds,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._refusal is not None:
            if scope["type"] == "lifespan":
                await refuse_startup(self._refusal, receive, send)
            raise self._refusal
        if self._openapi is not None:  # the first scope: document its app, once
            openapi, self._openapi = self._openapi, None
            openapi.install(scope)
            if scope["type"] != "lifespan":
                # No lifespan ran to check the routes: log what it would have refused. A
                # misplaced decorator or a lock longer than the retention also fails its own
                # route's requests; a decorated handler that a route would run unguarded for an
                # unsafe method fails every request; a decorator on a route whose methods are
                # not guarded changes nothing.
                problems = self._startup_check.route_problems(scope)
                if problems is not None:
                    logger.error("idempotency configuration: %s", problems)
                    self._refusal = self._unguarded_methods(scope)
                    if self._refusal is not None:
                        raise self._refusal
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._startup_check.run(self.app, scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        held = scope.get(REQUEST_SCOPE_KEY)
        if held is not None and held is GUARDED_SCOPE.get(_NO_SCOPE).get(REQUEST_SCOPE_KEY):
            # The guard of an app mounting this one owns the request's key, and runs it now:
            # one request, one guard (a second would mark the endpoint's start on its own
            # lease alone). A request the app makes to itself in process has a scope of its own.
            await self.app(scope, receive, send)
            return
        # The mark tells an @idempotent endpoint that a guard saw its request, and as what;
        # the context variable, how to find it (the endpoint's own arguments need not hold it).
        token = GUARDED_SCOPE.set(scope)
        scope[RUN_SCOPE_KEY] = run = GuardRun()  # anew: the same scope may come again
        run.ended = False
        run_token = GUARD_RUN.set(run)
        try:
            method = scope["method"]
            if method not in self._methods:
                upper = method.upper()
                if (
                    upper in self._methods
                    and self._resolver.resolve({**scope, "method": upper}, self.app) is not None
                ):
                    # "post" to a guarded route: an app that reads methods case-blind (one
                    # mounted whole) would run it unguarded.
                    await self._services.errors.send(
                        send,
                        Problem.INVALID_REQUEST,
                        f"The method {method} is {upper} in another case: send it in upper case",
                        request_headers=scope["headers"],
                    )
                    return
                scope[GUARD_SCOPE_KEY] = METHOD_NOT_GUARDED
                await self.app(scope, receive, send)
                return
            resolved = self._resolver.resolve(scope, self.app)
            if resolved is None:
                scope[GUARD_SCOPE_KEY] = None
                await self.app(scope, receive, send)
                return
            route, key_template = resolved
            scope[GUARD_SCOPE_KEY] = route.handler
            await GuardedRequest(self._services, route, key_template, scope, receive, send).start()
        finally:
            run.ended = True
            GUARD_RUN.reset(run_token)
            GUARDED_SCOPE.reset(token)

    def _unguarded_methods(self, scope: Scope) -> ConfigurationError | None:
        """What refuses every request of an app whose lifespan did not run (a mounted app, a
        server run with ``--lifespan off``): a decorated handler that would run unguarded for
        an unsafe method its route serves."""
        routes = routes_for(scope, self.app)
        problems = None if routes is None else self._resolver.unguarded(routes, self._methods)
        return None if problems is None else ConfigurationError(problems)

    def _check_routes(self, scope: Scope) -> list[ServedOperation]:
        """Refuse routes that would not work as written; the operations the app guards."""
        routes = routes_for(scope, self.app)
        if routes is None:
            return []
        self._resolver.check(routes, self._methods)
        mounted = _mounted_problems(routes)
        if mounted:
            raise ConfigurationError("\n".join(mounted))
        guarded = [
            (method, entry)
            for entry in iter_routes(routes)
            if self._resolver.policy_for(entry.handler) is not None
            for method in (entry.methods or self._methods) & self._methods
        ]
        # The guarded endpoints, as events name them: metrics can exist at zero from now.
        endpoints = {f"{method} {entry.template}" for method, entry in guarded}
        self.observer.declare(sorted(endpoints), self._services.store.name)
        return claimable(
            # Under a Host, the storage key holds the host: so does the claim.
            ServedOperation(method, entry.host + entry.template, code_name(entry.handler))
            for method, entry in guarded
            if operation_of(entry.handler) is None  # a name given is the identity: shared
        )
