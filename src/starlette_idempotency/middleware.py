"""The pure-ASGI middleware: its options, the route lookup, and the store calls.

Non-HTTP scopes, other methods and undecorated routes pass straight through; a guarded
request is handed to :class:`~starlette_idempotency.guarded.GuardedRequest`, which drives the
state machine through :meth:`IdempotencyMiddleware.call_store`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from starlette.requests import HTTPConnection

from starlette_idempotency._types import (
    DEFAULT_HEADER_NAME,
    ASGIApp,
    Clock,
    Receive,
    Scope,
    Send,
    system_clock,
)
from starlette_idempotency.deadlines import CallDeadlines
from starlette_idempotency.errors import (
    ConfigurationError,
    StoreError,
    StoreTimeoutError,
)
from starlette_idempotency.guarded import GuardedRequest
from starlette_idempotency.loop_timers import PerLoop
from starlette_idempotency.observability import (
    EventHook,
    KeyLogging,
    MetricsSink,
    Observer,
    StoreCallTracer,
)
from starlette_idempotency.openapi import OpenAPIDocumenter
from starlette_idempotency.policy import (
    FingerprintChangePolicy,
    FingerprintMode,
    IdempotencyPolicy,
    InProgressPolicy,
    RecoveryPolicy,
    ReplayPolicy,
    StoreErrorPolicy,
    unknown_option_error,
)
from starlette_idempotency.renewal import RENEWAL_RESOLUTION
from starlette_idempotency.responses import (
    ErrorFormat,
    ErrorResponder,
)
from starlette_idempotency.routing import RouteResolver, routes_for
from starlette_idempotency.store_check import StartupCheck, StoreCheckPolicy
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.waiting import Waiters

logger = logging.getLogger(__name__)

KeyScope = Callable[[HTTPConnection], "str | Awaitable[str | None] | None"]
"""Returns the owner of a request's keys (a user or tenant id); sync or async."""


_T = TypeVar("_T")

_UNSCOPED_WARNING = (
    "Idempotency keys are not scoped to a user: no key_scope was given and no "
    "authentication middleware set scope['user'], so two clients sending the same key "
    "share one stored response. Pass key_scope= or add the authentication middleware "
    "outside IdempotencyMiddleware."
)
_ANONYMOUS_WARNING = (
    "Idempotency keys of unauthenticated requests are not scoped to anyone: scope['user'] is "
    "not authenticated, so two anonymous clients sending the same key share one stored "
    "response. Require authentication on guarded routes, or pass key_scope= to scope their "
    "keys (by API key, session or client id)."
)


@functools.cache
def _option_names() -> frozenset[str]:
    parameters = inspect.signature(IdempotencyMiddleware.__init__).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)


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
            name
            for name in ("try_acquire", "complete", "fail", "release", "renew", "get")
            if not callable(getattr(store, name, None))
        ]
        raise ConfigurationError(
            f"store must implement the IdempotencyStore protocol (MemoryStore, RedisStore, "
            f"PostgresStore or your own); {type(store).__name__} lacks "
            f"{', '.join(missing) or 'the name and supports_recovery attributes'}"
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
        ttl_hours: float = 24.0,
        lock_ttl_seconds: float = 30.0,
        required: bool = True,
        exclude_fields: Sequence[str] = (),
        fingerprint_headers: Sequence[str] = (),
        on_store_error: StoreErrorPolicy = "fail_closed",
        renew_lock: bool = True,
        fingerprint: FingerprintMode = "raw",
        fingerprint_version: str = "1",
        on_fingerprint_change: FingerprintChangePolicy = "replay",
        on_in_progress: InProgressPolicy = "conflict",
        wait_timeout_seconds: float = 10.0,
        replay: ReplayPolicy = "response",
        max_response_bytes: int = 1024 * 1024,
        on_recovery: RecoveryPolicy = "handler",
        max_waiters: int = 1000,
        pod_id: str | None = None,
        log_keys: KeyLogging = "raw",
        on_event: EventHook | None = None,
        metrics: MetricsSink | None = None,
        tracing: bool = False,
        check_store: StoreCheckPolicy = "warn",
        clock: Clock = system_clock,
    ) -> None:
        _check_store_object(store)
        if min(max_key_length, max_waiters) < 1 or max_body_bytes < 0 or store_timeout_seconds <= 0:
            raise ConfigurationError(
                "max_key_length, max_waiters, max_body_bytes and store_timeout_seconds "
                "must be positive"
            )
        self.app = app
        self.store = store
        self.header_name = header_name
        self._header_bytes = header_name.lower().encode("latin-1")
        self._methods = frozenset(method.upper() for method in methods)
        self._max_key_length = max_key_length
        self._key_scope = key_scope
        self._max_body_bytes = max_body_bytes
        self._deadlines = CallDeadlines(store_timeout_seconds)
        #: Where running handlers wait for their first lock renewal (one timer per loop).
        self.renewal_timers = PerLoop(RENEWAL_RESOLUTION)
        self._clock = clock
        defaults = IdempotencyPolicy(
            ttl_hours=ttl_hours,
            lock_ttl_seconds=lock_ttl_seconds,
            required=required,
            exclude_fields=tuple(exclude_fields),
            fingerprint_headers=tuple(fingerprint_headers),
            on_store_error=on_store_error,
            renew_lock=renew_lock,
            fingerprint=fingerprint,
            fingerprint_version=fingerprint_version,
            on_fingerprint_change=on_fingerprint_change,
            on_in_progress=on_in_progress,
            wait_timeout_seconds=wait_timeout_seconds,
            replay=replay,
            max_response_bytes=max_response_bytes,
            on_recovery=on_recovery,
        )
        self._resolver = RouteResolver(defaults, protect_all=protect_all)
        self._errors = ErrorResponder(
            header_name=header_name, error_format=error_format, problem_type=problem_type
        )
        # Installed by the first scope, which names the app (there is none before: see openapi.py)
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
        self._tracer = StoreCallTracer() if tracing else None
        self.waiters = Waiters(store, self.call_store, max_waiters)
        self._store_name = str(getattr(store, "name", type(store).__name__))
        self._store_never_blocks = bool(getattr(store, "never_blocks", False))
        self._startup_check = StartupCheck(store, check_store, self._check_routes)
        self._warned: set[str] = set()  # one-time warnings already logged
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
        await GuardedRequest(self, route, scope, receive, send).run()

    def _check_routes(self, scope: Scope) -> None:
        routes = routes_for(scope, self.app)
        if routes is not None:
            self._resolver.check(routes, self._methods)

    def call_store(self, operation: Callable[..., Awaitable[_T]], *args: Any) -> Awaitable[_T]:
        """Run one store call within ``store_timeout_seconds``; any failure is a StoreError.

        Returns the awaitable rather than awaiting it: one coroutine frame fewer to suspend
        and resume on every store call.
        """
        if self._tracer is None and self.observer.metrics is None:
            return self._bounded(operation, args)
        return self._observed(operation, args)

    async def _observed(self, operation: Callable[..., Awaitable[_T]], args: tuple[Any, ...]) -> _T:
        """:meth:`_bounded`, timed for the metrics sink and traced as a span."""
        name = getattr(getattr(operation, "func", operation), "__name__", "call")
        metrics = self.observer.metrics
        started = time.perf_counter()
        ok = False
        try:
            if self._tracer is None:
                result = await self._bounded(operation, args)
            else:
                with self._tracer.span(self._store_name, name):
                    result = await self._bounded(operation, args)
            ok = True
            return result
        finally:
            if metrics is not None:
                metrics.observe_store_call(
                    self._store_name, name, time.perf_counter() - started, ok
                )

    async def _bounded(self, operation: Callable[..., Awaitable[_T]], args: tuple[Any, ...]) -> _T:
        try:
            if self._store_never_blocks:  # even the cheapest deadline costs more than the call
                return await operation(*args)
            with self._deadlines.bound():
                return await operation(*args)
        except StoreError:
            raise
        except TimeoutError as exc:
            raise StoreTimeoutError(
                f"idempotency store call took longer than {self._deadlines.timeout}s"
            ) from exc
        except Exception as exc:
            raise StoreError(f"idempotency store call failed: {exc!r}") from exc

    async def scope_id(self, scope: Scope) -> str:
        """Who owns the keys of this request: ``key_scope``'s answer or the authenticated user."""
        if self._key_scope is not None:
            value = self._key_scope(HTTPConnection(scope))
            if inspect.isawaitable(value):
                value = await value
            return "" if value is None else str(value)
        user = scope.get("user")
        if user is None:
            self._warn_once(_UNSCOPED_WARNING)
            return ""
        if not getattr(user, "is_authenticated", False):
            self._warn_once(_ANONYMOUS_WARNING)
            return ""
        try:
            identity = user.identity
        except (AttributeError, NotImplementedError):
            identity = None
        return str(identity or getattr(user, "display_name", "") or "")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)
