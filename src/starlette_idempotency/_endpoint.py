"""The endpoint side: ``@idempotent``, what the endpoint and the middleware tell each other
about one request, and what a handler can learn and record about its own request.

The decorator records which options a route overrides; the middleware merges them over its own
defaults once per route. In the documented order (``@app.post(...)`` above ``@idempotent(...)``)
the decorator also wraps the endpoint. The wrapper runs on every call: it checks that a guard
saw the request it runs for (:func:`enter_endpoint`), and it tells the middleware that the
endpoint itself began, which tells a FastAPI validation 422 or an auth dependency's 401
(nothing ran) from a handler's own 4xx (a business outcome). The wrapper is a plain
``functools.wraps`` wrapper: FastAPI's introspection and OpenAPI see the original function's
signature, untouched.

The middleware hands the endpoint side what it decided through a context variable
(:data:`GUARDED_SCOPE`, as asgi-correlation-id hands on its request id), set for every HTTP
request it passes on and reset when the app returns: the scope it passed on, marked
(:data:`GUARD_SCOPE_KEY`) with the ``@idempotent`` wrapper it guards the request for,
:data:`METHOD_NOT_GUARDED`, or ``None`` when it found no guarded route. The endpoint runs in
the request's task, or in a thread that copied its context (a sync endpoint), so the wrapper
finds it whatever its signature. A decorator stacked above ``@idempotent`` with
``functools.wraps`` (a rate limiter, a cache) is looked through by its ``__wrapped__`` chain.
With no guard in the context, the wrapper runs the function as written, as a unit test's
direct call does; it refuses only a call that brings a request a router dispatched.

A request that owns its key carries its :class:`IdempotencyContext` in the scope: where the
endpoint reports that it began, :func:`mark_retryable` that a failure had no side effect, and
:func:`checkpoint` saves a recovery point; if the process dies after one, the retry that takes
the key over sees it through ``idempotency_context(request).recovered_from`` and can reconcile
(ask the payment provider what happened) instead of acting again.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import logging
import re
import types
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, Unpack, cast, overload

from starlette.requests import HTTPConnection

from starlette_idempotency._options import (
    ROUTE_OPTIONS,
    IdempotencyPolicy,
    RouteOptions,
    unknown_option_error,
)
from starlette_idempotency._record import Checkpoint
from starlette_idempotency._types import Scope
from starlette_idempotency.errors import (
    ConfigurationError,
    IdempotencyError,
    UnguardedRequestError,
)

logger = logging.getLogger(__name__)

#: Where the middleware records, for every HTTP request it passes on, what it guards it as.
GUARD_SCOPE_KEY = "starlette_idempotency.guard"
#: The scope the innermost guard passed on, for the ``@idempotent`` wrapper of its request to
#: find: set by the middleware for each HTTP request, and reset when the app returns.
GUARDED_SCOPE: ContextVar[Scope] = ContextVar("starlette_idempotency.guarded_scope")
#: Where the guard puts its :class:`GuardRun` for the request it passes on.
RUN_SCOPE_KEY = "starlette_idempotency.run"


class GuardRun:
    """One pass of a request through a guard: what tells its scope, and a copy a middleware
    made of it, from another request's (whose context a task that request started carries
    into calls made for others), and whether it has ended. Slotted, set by the guard: no dict
    per request, and no ``__init__`` call on the request path."""

    __slots__ = ("ended",)
    ended: bool


#: The run of the request whose scope :data:`GUARDED_SCOPE` holds. Apart from the scope, whose
#: run a guard inside may replace (nested guards share one scope), as its context resets it.
GUARD_RUN: ContextVar[GuardRun] = ContextVar("starlette_idempotency.guard_run")


@dataclass(frozen=True, slots=True)
class PassedOn:
    """The guard's mark for a request it passed on unguarded: the methods an ``@idempotent``
    endpoint may still run for."""

    methods: frozenset[str]


#: The guard's mark for a request whose method it does not guard (a GET, say): an
#: ``@idempotent`` endpoint runs for it only as a method that changes nothing (RFC 9110), not
#: as the PUT a route added later serves, or the POST a method override makes of it.
METHOD_NOT_GUARDED: Final = PassedOn(frozenset({"GET", "HEAD", "OPTIONS", "TRACE"}))
#: Where a guarded request's :class:`Marks` are (its :class:`IdempotencyContext`, once it owns
#: its key).
REQUEST_SCOPE_KEY = "starlette_idempotency.request"
#: No guard saw the request (none set :data:`GUARDED_SCOPE`).
_UNSEEN: Final = object()


class Marks(Protocol):
    """What the endpoint side reports to the middleware about one request."""

    #: The endpoint itself began (the decorator's wrapper ran).
    endpoint_started: bool
    #: :func:`mark_retryable`: the failure had no side effect, so the key is freed.
    retryable: bool
    #: The endpoint must not begin (its body is no valid command, and no key was acquired).
    must_not_start: bool
    #: The response started: its status is the outcome's (see :func:`mark_retryable`).
    started: bool
    #: The outcome is decided: the response ended, or the key was freed.
    decided: bool
    #: The key was freed for a retry.
    freed: bool


class InvalidCommandMarks:
    """The marks of a request whose body ``fingerprint="validated"`` found invalid: the app
    answers it (its own 422), and the endpoint must not begin unprotected."""

    __slots__ = ("decided", "endpoint_started", "freed", "must_not_start", "retryable", "started")

    def __init__(self) -> None:
        self.endpoint_started = False
        self.retryable = False
        self.must_not_start = True
        self.started = self.decided = self.freed = False


class UnprotectedEndpointError(RuntimeError):
    """The endpoint began on a body that ``fingerprint="validated"`` found invalid.

    The app's validation accepted what its own body model rejects, so no key was acquired;
    running the endpoint would be unprotected.
    """


def _name(handler: Any) -> str:
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', handler)}"


def _refusal(handler: Any, scope: Any, mark: Any) -> UnguardedRequestError:
    route = f"{scope.get('method')} {scope.get('path')}"
    if mark is _UNSEEN:
        cause = (
            "no IdempotencyMiddleware saw this request. Add it to the app that serves the "
            "route (app.add_middleware(IdempotencyMiddleware, store=...)), or to an app that "
            "mounts it; an app under test needs it too"
        )
    elif isinstance(mark, PassedOn) and scope.get("method") in mark.methods:
        cause = (
            "IdempotencyMiddleware passed the request on as one of a method it does not guard, "
            "and a middleware inside it handed the router a copy of the request, whose method "
            "the handler cannot see (it has no Request parameter): add IdempotencyMiddleware "
            "inside that middleware, or give the handler a Request parameter"
        )
    elif isinstance(mark, PassedOn):
        cause = (
            "IdempotencyMiddleware passed the request on as one of a method it does not guard, "
            "and it reached the handler as an unsafe one: a middleware inside "
            "IdempotencyMiddleware changed its method (a method override: add "
            "IdempotencyMiddleware inside it), or the route serves the handler for a method "
            "the middleware does not guard (add it to the middleware's methods=, or take it "
            "off the route)"
        )
    elif mark is None:
        cause = (
            "IdempotencyMiddleware saw the request but found no guarded route for it, so "
            "something between them changed where it goes (a middleware inside "
            "IdempotencyMiddleware that rewrites the path, or an app it cannot see into), or a "
            "decorator above @idempotent hides it (one without functools.wraps). Add "
            "IdempotencyMiddleware inside that middleware (app.add_middleware it first), "
            "mount the app so that its routes are reachable through .routes, or decorate with "
            "functools.wraps"
        )
    else:
        guarded = _name(mark)
        if guarded == _name(handler):  # two functions of one name: say where the other is
            code = getattr(getattr(mark, "__wrapped__", mark), "__code__", None)
            if code is not None:
                guarded += f" (defined at {code.co_filename}:{code.co_firstlineno})"
        cause = (
            f"IdempotencyMiddleware guarded the request as one to {guarded}, so its key and "
            "policy are another endpoint's (a middleware inside IdempotencyMiddleware "
            "rewrote the path, the route sits in an app it cannot see into, or another "
            "endpoint called this one)"
        )
    return UnguardedRequestError(f"@idempotent {_name(handler)} was not run for {route}: {cause}")


def enter_endpoint(handler: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Called by the ``@idempotent`` wrapper ``handler`` as it starts, with its arguments.

    Refused unless the guard of the request it runs for (:data:`GUARDED_SCOPE`) guarded it as
    a request to this very wrapper, or passed it on because its method is not guarded and it
    runs for a safe one (a GET, not a PUT a method override made of it). A context that is
    another request's (a task that request started, running or ended: the guard's
    :class:`GuardRun` tells) yields to the guarded request among the arguments; without one, a
    context whose request has ended is refused, and one whose request still runs cannot be
    told from this call's own (an endpoint without a ``Request``: see ``Lease.outcome``). With
    no guard in the context (a decorator above that runs the endpoint in an executor, which
    copies no context), the request among its arguments says what its guard did; a call that
    brings a request a router dispatched that no guard saw is refused; any other runs (a unit
    test's direct call, or one whose context was lost: the guard keeps its answer).
    """
    # The request among its arguments: a Starlette endpoint's first (after ``self`` for an
    # HTTPEndpoint), or a FastAPI endpoint's Request parameter.
    request: HTTPConnection | None = None
    for arg in (*args[:2], *kwargs.values()):
        if isinstance(arg, HTTPConnection):
            request = arg
            break
    scope = GUARDED_SCOPE.get(None)
    if scope is not None:
        run = GUARD_RUN.get(None)
        ended = run is not None and run.ended
        if request is not None and GUARD_SCOPE_KEY in request.scope:
            if ended or request.scope.get(RUN_SCOPE_KEY) is not run:
                scope = request.scope  # the context is another request's
        elif ended:
            if request is None:
                raise UnguardedRequestError(
                    f"@idempotent {_name(handler)} runs in a task an earlier request started, "
                    "with that request's context, after it ended, and takes no Request: it "
                    "cannot tell which request it runs for. Give it a Request parameter, or "
                    "run it in its own request's context (await it there, or hand the task "
                    "contextvars.copy_context() from the request)"
                )
            scope = None  # what its request says decides, as with no context
    if scope is None:
        if request is None or "endpoint" not in request.scope:
            return
        if GUARD_SCOPE_KEY not in request.scope:  # a request a router dispatched, unguarded
            raise _refusal(handler, request.scope, _UNSEEN)
        scope = request.scope
    mark = scope.get(GUARD_SCOPE_KEY)
    if mark is not handler:
        seen = scope if request is None else request.scope
        if not (
            isinstance(mark, PassedOn)
            and seen["method"] in mark.methods
            # With no request among its arguments (a FastAPI endpoint), the method seen is the
            # guard's: it is the one run only if the router dispatched the guard's own scope,
            # not a copy a middleware between made (a method override may have changed it).
            and (request is not None or idempotent_wrapper(seen.get("endpoint")) is handler)
        ):
            raise _refusal(handler, seen, mark)
    marks: Marks | None = scope.get(REQUEST_SCOPE_KEY)
    if marks is not None:
        if marks.must_not_start:
            raise UnprotectedEndpointError(UnprotectedEndpointError.__doc__)
        marks.endpoint_started = True


def mark_retryable(request: HTTPConnection) -> None:
    """Tell the middleware this request's failure had no side effect: release its key.

    Call it from a handler that refuses a request before writing anything (a duplicate e-mail,
    say), so the client may fix the problem and retry with the same key. Outside a guarded
    request it does nothing. Once the response has started (from a streamed body, or a
    background task, which runs after it) it changes nothing: the outcome is decided, and its
    client may have it; unless the key was freed already, a warning says so.
    """
    marks: Marks | None = request.scope.get(REQUEST_SCOPE_KEY)
    if marks is None:
        return
    if marks.started or marks.decided:
        # Honoured, it would free the key of a response its client has (or is getting), for a
        # retry to run the handler again.
        if not marks.freed:
            logger.warning(
                "mark_retryable() came after the response to this request started, and "
                "changes nothing: its outcome is decided, and its client may have it. Call it "
                "before the response starts, not from a streamed body or a background task"
            )
        return
    marks.retryable = True


class KeyOwner:
    """What the endpoint side can reach of a request that owns its key (the middleware's lease
    on it): the base a lease declares itself by, with the few members the endpoint side uses."""

    __slots__ = ()

    #: The request's idempotency key, as the client sent it.
    key: str
    #: The key as the store knows it (scope, method, route and key).
    store_key: str
    #: Recovery points left by an earlier attempt that died, oldest first.
    inherited: tuple[Checkpoint, ...]

    @property
    def request_fingerprint(self) -> str:
        raise NotImplementedError

    async def checkpoint(self, name: str, data: Any = None) -> None:
        raise NotImplementedError


_DERIVED_KEY_DOMAIN = b"starlette-idempotency derived key v1\0"
_LABEL = re.compile(r"[\x21-\x7e]{1,200}")


class IdempotencyContext:
    """What a handler can learn and record about its own guarded request, once it owns its
    key (what :func:`idempotency_context` returns): the key, the recovery points an earlier
    attempt left, :meth:`checkpoint` and :meth:`derived_key`. A read-only view: the outcome is
    the middleware's to decide."""

    __slots__ = ("_owner",)

    def __init__(self, owner: KeyOwner) -> None:
        self._owner = owner

    @property
    def key(self) -> str:
        """The request's idempotency key."""
        return self._owner.key

    @property
    def inherited(self) -> tuple[Checkpoint, ...]:
        """Recovery points left by an earlier attempt that died, oldest first."""
        return self._owner.inherited

    @property
    def recovered_from(self) -> str | None:
        """The last recovery point of the attempt this request took over, if any."""
        inherited = self._owner.inherited
        return inherited[-1].name if inherited else None

    @property
    def recovery_data(self) -> Any:
        """The data saved with :attr:`recovered_from`."""
        inherited = self._owner.inherited
        return inherited[-1].data if inherited else None

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """Save a recovery point (JSON-serialisable ``data``) before the request goes on.

        Raises :class:`~starlette_idempotency.errors.LockLostError` when another request has
        taken the key over, ``IdempotencyError`` once the request's outcome is decided (from a
        background task), and ``StoreError`` when it could not be saved: either way, do not go
        on with the side effect.
        """
        await self._owner.checkpoint(name, data)

    def derived_key(self, label: str) -> str:
        """An idempotency key for a call this request makes to another service (a payment
        provider, an internal API), named by ``label`` (``"stripe.charge"``, say).

        It is the same on every retry of this request and after a takeover of its key, so the
        provider answers a second attempt with the first one's result; it differs for every
        other key, route, scope, request body and label. 43 characters of ``[A-Za-z0-9_-]``
        (an unpadded base64url SHA-256), from which neither the client's key nor the scope can
        be read back.
        """
        if not isinstance(label, str) or _LABEL.fullmatch(label) is None:
            raise ConfigurationError(
                f"derived_key() takes a label of 1 to 200 visible ASCII characters, such as "
                f"'stripe.charge', not {label!r}"
            )
        owner = self._owner
        digest = hashlib.sha256(
            b"\0".join(
                (
                    _DERIVED_KEY_DOMAIN,
                    owner.store_key.encode(),
                    owner.request_fingerprint.encode(),
                    label.encode(),
                )
            )
        ).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def idempotency_context(request: HTTPConnection) -> IdempotencyContext:
    """The context of a guarded request that owns its idempotency key."""
    return IdempotencyContext(key_owner(request))


def key_owner(request: HTTPConnection) -> KeyOwner:
    """The lease of a guarded request that owns its key; ``IdempotencyError`` otherwise."""
    owner = request.scope.get(REQUEST_SCOPE_KEY)
    if not isinstance(owner, KeyOwner):
        raise IdempotencyError(
            "no idempotency context: the request is not guarded by IdempotencyMiddleware "
            "or did not acquire its key"
        )
    return owner


async def checkpoint(request: HTTPConnection, name: str, data: Any = None) -> None:
    """Save a recovery point on the request's idempotency record (see the module docs)."""
    await idempotency_context(request).checkpoint(name, data)


_F = TypeVar("_F", bound=Callable[..., Any])

POLICY_ATTRIBUTE = "__idempotency_overrides__"
#: The ``operation=`` of ``@idempotent`` (``None`` when not given).
OPERATION_ATTRIBUTE = "__idempotency_operation__"
#: How many ``__wrapped__`` links are followed from a route's handler to its ``@idempotent``.
_MAX_WRAPPING = 32

# What a route's options are checked against when the decorator runs (see idempotent()).
_LOOSEST = IdempotencyPolicy(ttl_hours=1e9, lock_ttl_seconds=1e-9)

#: Every ``@idempotent`` wrapper: what tells one from a decorator above it, which
#: ``functools.wraps`` gives the same name and attributes.
_WRAPPERS: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
#: The options given for each decorated bound method, by its instance's id and its function:
#: a bound method takes no attributes, yet a router holding it undecorated (the decorator above
#: the route decorator, whose wrapper nothing keeps) must be told from one never decorated. An
#: entry ends with its instance; one that takes no weak reference is kept alive by it instead,
#: so that no other object comes to have its id.
_METHOD_OVERRIDES: dict[tuple[int, object], tuple[object, dict[str, Any]]] = {}


def _remember_method(method: types.MethodType, overrides: dict[str, Any]) -> None:
    key = (id(method.__self__), method.__func__)
    try:
        weakref.finalize(method.__self__, _METHOD_OVERRIDES.pop, key, None)
    except TypeError:  # no weak reference to it
        _METHOD_OVERRIDES[key] = (method.__self__, overrides)
    else:
        _METHOD_OVERRIDES[key] = (None, overrides)


def idempotent_wrapper(handler: object) -> Callable[..., Any] | None:
    """The ``@idempotent`` wrapper a route's handler is, or wraps through decorators that set
    ``__wrapped__`` (``functools.wraps``: a rate limiter, a cache); ``None`` when there is none.

    A bound method (an instance's, a classmethod's) is looked through to its function: its
    ``__wrapped__`` is the function's, which leads past the wrapper to the undecorated one."""
    node: object = handler
    for _ in range(_MAX_WRAPPING):
        if inspect.ismethod(node):
            node = node.__func__
        # Every wrapper is a plain function, and a set compares by equality: a proxy (wrapt's)
        # equals what it wraps, and an unhashable endpoint (a dataclass instance) would raise.
        if type(node) is types.FunctionType and node in _WRAPPERS:
            return cast(Callable[..., Any], node)
        node = getattr(node, "__wrapped__", None)
        if node is None:
            break
    return None


def overrides_set_on(handler: object) -> dict[str, Any] | None:
    """The options ``@idempotent`` set on ``handler`` as the router holds it, undecorated or
    not: on a function, or on the wrapper made of a bound method (``None``: not decorated)."""
    if inspect.ismethod(handler):
        remembered = _METHOD_OVERRIDES.get((id(handler.__self__), handler.__func__))
        if remembered is not None:
            return remembered[1]
    overrides: dict[str, Any] | None = getattr(handler, POLICY_ATTRIBUTE, None)
    return overrides


def _wrap_marking_start(func: _F) -> _F:
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            enter_endpoint(async_wrapper, args, kwargs)
            return await func(*args, **kwargs)

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            enter_endpoint(sync_wrapper, args, kwargs)
            return func(*args, **kwargs)

        wrapper = sync_wrapper
    _WRAPPERS.add(wrapper)
    return cast(_F, wrapper)


@overload
def idempotent(func: _F, /) -> _F: ...


@overload
def idempotent(
    func: None = None, /, *, operation: str | None = None, **options: Unpack[RouteOptions]
) -> Callable[[_F], _F]: ...


def idempotent(func: Any = None, /, *, operation: str | None = None, **options: Any) -> Any:
    """Make a POST/PATCH endpoint idempotent under :class:`IdempotencyMiddleware`.

    Every option left out takes the middleware's value, and so does one given as ``None``
    ("as the middleware says": a route cannot reset an option to its default with ``None``);
    the documentation's options reference describes each. Put it below ``@app.post(...)``;
    bare ``@idempotent`` takes every option from the middleware::

        @app.post("/payments")
        @idempotent(ttl_hours=48, lock_ttl_seconds=60)
        async def pay(body: Payment) -> Receipt: ...

    ``operation`` names what the route does (``"payments.create"``), in place of its method
    and path template in the records' keys: records stay the route's whatever its path,
    handler or module become, and two services on one store that name their operations apart
    never share a record. Without it, a route is its method and path template (never the
    handler's name: a renamed or moved handler keeps its records).
    """
    if func is not None and not callable(func):
        raise ConfigurationError(
            f"@idempotent takes its options by name, e.g. @idempotent(ttl_hours=48), not {func!r}"
        )
    unknown = options.keys() - ROUTE_OPTIONS
    if unknown:
        raise unknown_option_error(unknown, ROUTE_OPTIONS | {"operation"}, "@idempotent")
    if operation is not None and (
        not isinstance(operation, str) or _LABEL.fullmatch(operation) is None
    ):
        raise ConfigurationError(
            f"operation names what the route does in 1 to 200 visible ASCII characters, such "
            f"as 'payments.create', not {operation!r}"
        )
    given = {name: value for name, value in options.items() if value is not None}
    # Validate now, at import time, and keep the normalised values. Whether the lock outlives
    # the retention depends on the middleware's values too: merged with the loosest ones here,
    # it is checked with the real ones at startup.
    validated = _LOOSEST.merged(given)
    overrides = {name: getattr(validated, name) for name in given}

    def decorate(func: _F) -> _F:
        if idempotent_wrapper(func) is not None:
            raise ConfigurationError(
                f"@idempotent is applied twice to {_name(func)}: keep one, with every option "
                "the route needs"
            )
        # Set on the function itself too: in the reverse order the router already holds it. A
        # bound method (one instance's, its operation its own) takes none: its wrapper has them.
        wrapper = _wrap_marking_start(func)
        if inspect.ismethod(func):
            _remember_method(func, overrides)
            targets: tuple[object, ...] = (wrapper,)
        else:
            targets = (func, wrapper)
        for target in targets:
            setattr(target, POLICY_ATTRIBUTE, overrides)
            setattr(target, OPERATION_ATTRIBUTE, operation)
        return wrapper

    return decorate if func is None else decorate(func)


def misplaced_decorator_error(template: str) -> ConfigurationError:
    """``@idempotent`` above the route decorator: the router holds the undecorated endpoint,
    so the middleware could not tell a validation 422 from the handler's own."""
    return ConfigurationError(
        f"@idempotent is above the route decorator on {template}; put it below, so that it "
        f"wraps the endpoint the router calls:\n\n"
        f'    @app.post("{template}")\n    @idempotent(...)\n    async def endpoint(...): ...'
    )
