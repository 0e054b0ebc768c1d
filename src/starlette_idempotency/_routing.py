"""Finding the route a request will reach, before the app runs, and its idempotency policy.

The middleware must decide before the endpoint runs, so it repeats the router's matching on
every guarded request: the first FULL match wins, ``Mount`` and ``Host`` are entered with
their prefix joined into the template, and FastAPI's lazily included routers (``include_router``
since FastAPI 0.13x) are entered through their effective routes.

Nothing is cached by request. Which route a request reaches depends on its host,
``root_path``, method and path, on whatever a custom route matches on (any header), and on route
lists that may change after the first request (lists keep no version to compare). Matching
costs about 1 µs per Starlette route tried, several for FastAPI's included routes, and the
router pays as much again on the same request. Only the policy of a matched route is cached,
keyed by the route object, its endpoint, the effective route FastAPI runs an included one as
(read through ``_match``, as the matching itself; its body field is the one FastAPI validates
with) and its full template.

The routes are those of the app the middleware wraps, found by following ``.app`` down the
stack: the scope the middleware receives is the scope that app's router will match, however
many mounts were entered above it. ``scope["app"]`` can name a parent app whose routes sit
above that scope, so it is used only when its own middleware stack holds this middleware. An
app mounted whole with no router to find (a GraphQL or WSGI app) is itself the route its
requests reach, its mount path the template.

What tells two requests apart, by what Starlette matches on:

* method, and the route's full path template (mount prefixes joined): the storage key;
* host: the host the request matched, as its ``Host`` routes fill their patterns
  (``acme.shop.example`` for ``{tenant}.shop.example``), joins the template in the key;
  routes under no ``Host`` keep the key they always had;
* the path's own values (path parameters, mount parameters), the query and the chosen
  headers: the fingerprint, so a key reused for another value is a 422;
* an ``@idempotent(operation=...)``: in place of the template in the key, so the records
  stay the operation's whatever its path becomes, and two services on one store that name
  their operations apart never share one. The handler's name is in neither key nor
  fingerprint: a renamed or moved handler, or another launch mode (``python main.py`` against
  ``uvicorn main:app``), keeps its records. Two routes of one app (or two apps on one store
  and key prefix) that serve one method, template (or operation) and path share records.

Why one module: the route a request reaches and the routes walked at startup (the checks,
OpenAPI) must enter mounts, hosts and included routers alike, or the startup check would
judge other routes than the requests reach.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Host, Match, Mount, WebSocketRoute, replace_params

from starlette_idempotency._endpoint import (
    OPERATION_ATTRIBUTE,
    idempotent_wrapper,
    misplaced_decorator_error,
    overrides_set_on,
)
from starlette_idempotency._fingerprint import fingerprint_version
from starlette_idempotency._options import IdempotencyPolicy
from starlette_idempotency._types import ASGIApp, Scope
from starlette_idempotency.errors import ConfigurationError

if TYPE_CHECKING:
    from starlette_idempotency._command_fingerprint import CommandFingerprinter

logger = logging.getLogger(__name__)

_MAX_CACHED_ROUTES = 2048
_MAX_STACK_DEPTH = 64  # bounds the walk down ``.app`` attributes, should they ever form a cycle


@dataclass(frozen=True, slots=True)
class GuardedRoute:
    """A route the middleware guards: its template, merged policy, whether the endpoint reports
    its own start (the documented decorator order), and how its requests are fingerprinted.

    ``handler`` is the ``@idempotent`` wrapper the router calls for the request's method,
    itself or through decorators above it (the guard marks the request with it, and the
    wrapper checks the mark), or what the router calls when undecorated; ``operation`` is the
    ``operation=`` it names itself by (``None``: its method and template name it);
    ``decorated_above``: the router calls a decorator above the wrapper, which may run it where
    the request's context is lost (an executor), so that it cannot report its start.
    """

    template: str
    policy: IdempotencyPolicy
    marks_start: bool
    fingerprint_version: str
    handler: object
    operation: str | None
    command: CommandFingerprinter | None = None
    decorated_above: bool = False


@dataclass(frozen=True, slots=True)
class _Leaf:
    """The route a request reaches: ``endpoint`` is the route's (a function, a partial, an
    ``HTTPEndpoint`` class or a mounted app); ``host`` is the host the request matched, as
    the ``Host`` routes above it fill their patterns (``""`` when there are none);
    ``effective`` is what FastAPI runs a route of an included router as (``None`` for any
    other route), whose body field embeds the body beside the ``Body`` parameters of the
    inclusion's dependencies."""

    route: BaseRoute
    endpoint: Any
    template: str
    host: str = ""
    effective: object = None


def endpoint_handler(endpoint: object, method: str) -> object:
    """What a route's router calls for a ``method`` request to ``endpoint``: the function
    itself (a ``functools.partial`` unwrapped), or the method of an ``HTTPEndpoint`` class
    (``head`` falling back to ``get``, as Starlette dispatches)."""
    while isinstance(endpoint, functools.partial):
        endpoint = endpoint.func
    if isinstance(endpoint, type):
        name = method.lower()
        if name == "head" and not hasattr(endpoint, "head"):
            name = "get"
        return getattr(endpoint, name, None)
    return endpoint


def _handlers(endpoint: object) -> dict[str | None, object]:
    """Every handler of a route's endpoint: ``{method: handler}`` for a class, ``{None:
    handler}`` for anything else (which serves each of the route's methods)."""
    while isinstance(endpoint, functools.partial):
        endpoint = endpoint.func
    if not isinstance(endpoint, type):
        return {None: endpoint}
    return {
        name.upper(): handler
        for name in _HTTP_METHODS
        if (handler := getattr(endpoint, name, None)) is not None
    }


_HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options", "trace")
#: RFC 9110's safe methods: a decorated handler served for one unguarded changes nothing.
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})


def decoration(handler: object) -> tuple[Any, dict[str, Any] | None]:
    """The ``@idempotent`` wrapper a route's handler is or wraps (``None`` when there is none),
    and the options the decorator overrides (``None`` when the handler is not decorated).

    Overrides without a wrapper are a decorator placed above the route decorator: the router
    holds the undecorated function (or one that ``functools.wraps`` gave the attribute)."""
    wrapper = idempotent_wrapper(handler)
    return wrapper, overrides_set_on(handler if wrapper is None else wrapper)


def operation_of(handler: object) -> str | None:
    """The ``operation=`` a route's handler names itself by (``None`` when it names none)."""
    operation: str | None = getattr(decoration(handler)[0], OPERATION_ATTRIBUTE, None)
    return operation


@dataclass(frozen=True, slots=True)
class _Routes:
    """The routes an app dispatches to, and the ``root_path`` it sets before matching them
    (``FastAPI(root_path=...)`` does, in its own ``__call__``); ``""`` when it sets none."""

    routes: Sequence[BaseRoute]
    root_path: str = ""

    def scope_for(self, scope: Scope) -> Scope:
        """A copy of ``scope`` as this app's router will see it."""
        return {**scope, "root_path": self.root_path} if self.root_path else dict(scope)


_INCLUDED_ROUTER_TYPES: dict[type, bool] = {}


def _is_included_router(route: object) -> bool:
    """FastAPI's lazily included router (``include_router`` since FastAPI 0.13x), by type once:
    its public ``matches()`` hides which route matched, so it is entered through ``_match``."""
    kind = type(route)
    known = _INCLUDED_ROUTER_TYPES.get(kind)
    if known is None:
        known = _INCLUDED_ROUTER_TYPES[kind] = hasattr(kind, "_match") and hasattr(
            kind, "effective_candidates"
        )
    return known


def _included_router_match(route: Any, scope: Scope) -> tuple[Match, Scope, Any, Any]:
    result: tuple[Match, Scope, Any, Any] = route._match(scope)
    return result


def find_leaf(
    routes: Iterable[BaseRoute], scope: Scope, prefix: str = "", host: str = ""
) -> _Leaf | None:
    """The first route that fully matches ``scope``, with its full path template and the host
    it matched."""
    for route in routes:
        included = _INCLUDED_ROUTER_TYPES.get(type(route))  # known after the first request
        if included is None:
            included = _is_included_router(route)
        if included:
            match, child_scope, matched, context = _included_router_match(route, scope)
            if match is not Match.FULL:
                continue
            if _is_included_router(matched):
                return find_leaf([matched], scope, prefix, host)
            if isinstance(matched, Mount | Host):
                return _enter(matched, scope, child_scope, prefix, host)
            template = str(getattr(context, "path", None) or getattr(matched, "path", ""))
            return _Leaf(matched, child_scope.get("endpoint"), prefix + template, host, context)
        match, child_scope = route.matches(scope)
        if match is not Match.FULL:
            continue
        if isinstance(route, Mount | Host):
            return _enter(route, scope, child_scope, prefix, host)
        endpoint = child_scope.get("endpoint", getattr(route, "endpoint", None))
        return _Leaf(route, endpoint, prefix + getattr(route, "path", ""), host)
    return None


def _enter(
    route: Mount | Host, scope: Scope, child_scope: Scope, prefix: str, host: str
) -> _Leaf | None:
    if isinstance(route, Host):
        # The host joins the key: two hosts (or two tenants of one pattern) that serve one
        # path are two endpoints to the app.
        params = dict(child_scope.get("path_params", {}))
        host += replace_params(route.host_format, route.param_convertors, params)[0]
    below, inner_prefix = _inside(route, prefix)
    if below is None:  # an app mounted whole, with no router to look into: the mount is its route
        return _Leaf(route, route.app, inner_prefix, host)
    return find_leaf(below.routes, below.scope_for({**scope, **child_scope}), inner_prefix, host)


def _inside(route: Mount | Host, prefix: str) -> tuple[_Routes | None, str]:
    """The routes a ``Mount`` or ``Host`` dispatches to (``None`` for an app with no router
    to find), and the template prefix below it."""
    # ``Mount.routes`` is empty when the mounted app is wrapped (in IdempotencyMiddleware, say),
    # yet the router still dispatches through the wrapper to the routes below it.
    below = _routes_below(route.app) or (_Routes(route.routes) if route.routes else None)
    return below, prefix + route.path if isinstance(route, Mount) else prefix


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """A handler :func:`iter_routes` found: its route, full template, the methods it serves
    (empty for any), the handler (the endpoint, or one method of an ``HTTPEndpoint``), and the
    pattern of the ``Host`` route it is below (``""`` for none)."""

    route: BaseRoute
    template: str
    methods: frozenset[str]
    handler: object
    host: str = ""


def iter_routes(
    routes: Iterable[BaseRoute], prefix: str = "", host: str = ""
) -> Iterator[RouteEntry]:
    """Every route below ``routes`` that ends a match, in the order :func:`find_leaf` tries
    them: ``Mount``, ``Host`` and FastAPI's included routers are entered as it enters them."""
    for route in routes:
        if not _is_included_router(route):
            yield from _entries(route, prefix, "", host)
            continue
        included: Any = route
        for candidate in included.effective_candidates():
            if _is_included_router(candidate):
                yield from iter_routes([candidate], prefix, host)
            else:
                # An included APIRoute keeps its own path; its context holds the prefixed one.
                target = candidate.starlette_route or candidate.original_route
                path = str(getattr(candidate, "path", "") or "")
                yield from _entries(target, prefix, path, host)


def mounted_apps(routes: Iterable[BaseRoute], prefix: str = "") -> Iterator[tuple[str, object]]:
    """Every app mounted below ``routes`` (by a ``Mount`` or a ``Host``, at any depth), with the
    path it is mounted at: Starlette sends them no lifespan of their own."""
    for route in routes:
        if isinstance(route, Mount | Host):
            below, inner_prefix = _inside(route, prefix)
            yield inner_prefix, route.app
            if below is not None:
                yield from mounted_apps(below.routes, inner_prefix)


def _entries(route: BaseRoute, prefix: str, template: str, host: str) -> Iterator[RouteEntry]:
    if isinstance(route, Mount | Host):
        below, inner_prefix = _inside(route, prefix)
        inner_host = route.host if isinstance(route, Host) else host
        if below is None:
            yield RouteEntry(route, inner_prefix, frozenset(), route.app, inner_host)
        else:
            yield from iter_routes(below.routes, inner_prefix, inner_host)
        return
    methods = frozenset(getattr(route, "methods", None) or ())
    full_template = prefix + (template or getattr(route, "path", ""))
    for method, handler in _handlers(getattr(route, "endpoint", None)).items():
        served = methods if method is None else frozenset({method})
        yield RouteEntry(route, full_template, served, handler, host)


def _stack(app: object) -> Iterator[object]:
    """``app``, what it wraps (its ``.app``), what that wraps, and so on."""
    node: object = app
    for _ in range(_MAX_STACK_DEPTH):
        if node is None:
            return
        yield node
        node = getattr(node, "app", None)


def _wraps(outer: object, app: object) -> bool:
    return any(node is app for node in _stack(outer))


def _router_below(app: object) -> object | None:
    """The first layer found by following ``.app`` down from ``app`` that has routes."""
    for node in _stack(app):
        routes = getattr(node, "routes", None)
        if isinstance(routes, list) and all(isinstance(route, BaseRoute) for route in routes[:1]):
            return node
    return None


def _routes_below(app: object) -> _Routes | None:
    """The routes of the first router found by following ``.app`` down from ``app``."""
    node = _router_below(app)
    if node is None:
        return None
    root_path = getattr(node, "root_path", "")
    routes: Sequence[BaseRoute] = getattr(node, "routes")  # noqa: B009 - checked above
    return _Routes(routes, root_path if isinstance(root_path, str) else "")


def _router_for(scope: Scope, app: ASGIApp) -> _Routes | None:
    """The routes a middleware wrapping ``app`` matches ``scope`` against, if it finds them.

    Where ``.app`` leads to no router (a plain function middleware in between, or the
    middleware given to one ``Route(middleware=...)``), the app named in the scope is used
    instead, but only once its own stack is seen to hold ``app``.
    """
    below = _routes_below(app)
    if below is None:
        owner = scope.get("app")
        if owner is not None and _wraps(getattr(owner, "middleware_stack", None), app):
            below = _routes_below(owner)
    return below


def routes_for(scope: Scope, app: ASGIApp) -> Sequence[BaseRoute] | None:
    """The route list a middleware wrapping ``app`` resolves the requests of ``scope`` in."""
    below = _router_for(scope, app)
    return None if below is None else below.routes


class RouteResolver:
    """Maps a request to its :class:`GuardedRoute` (or ``None`` when it is not guarded)."""

    def __init__(self, defaults: IdempotencyPolicy, *, protect_all: bool) -> None:
        self._defaults = defaults
        self._protect_all = protect_all
        # The key holds ids; the value holds the objects themselves, so that no id in a key can
        # be reused by a new route or endpoint while the entry lives.
        self._cache: dict[
            tuple[int, int, int, str, str],
            tuple[BaseRoute, object, object, GuardedRoute | None],
        ] = {}
        self._warned_unrouted = False
        # The app the middleware wraps, and the first layer below it with routes (None when
        # there is none): found once, as the stack below a middleware does not change. Its
        # routes are read afresh on every request.
        self._below: tuple[object, object | None] | None = None

    def resolve(self, scope: Scope, app: ASGIApp) -> tuple[GuardedRoute, str] | None:
        """The guarded route ``scope`` reaches in ``app`` and the template its storage keys
        take (its ``operation=``, or else its path template, after the host the request
        matched, if any); ``None`` when the request is not guarded."""
        below = self._below
        if below is None or below[0] is not app:
            below = self._below = (app, _router_below(app))
        router = below[1]
        if router is None:
            leaf = self._locate(scope, app)
        else:
            root_path = getattr(router, "root_path", "")
            leaf = find_leaf(
                router.routes,  # type: ignore[attr-defined]
                # A copy: FastAPI's included routers write into the scope while matching.
                {**scope, "root_path": root_path}
                if isinstance(root_path, str) and root_path
                else dict(scope),
            )
        if leaf is None:
            return None
        method = scope["method"]
        route, endpoint, effective = leaf.route, leaf.endpoint, leaf.effective
        cache_key = (id(route), id(endpoint), id(effective), leaf.template, method)
        cached = self._cache.get(cache_key)
        if (
            cached is not None
            and cached[0] is route
            and cached[1] is endpoint
            and cached[2] is effective
        ):
            guarded = cached[3]
        else:
            guarded = self._guarded_route(leaf, method)
            if len(self._cache) >= _MAX_CACHED_ROUTES:
                self._cache.clear()
            self._cache[cache_key] = (route, endpoint, effective, guarded)
        if guarded is None:
            return None
        template = guarded.operation or leaf.template
        return guarded, leaf.host + template if leaf.host else template

    def check(self, routes: Iterable[BaseRoute], methods: frozenset[str]) -> None:
        """Refuse, at startup, every ``@idempotent`` handler that would not work as written:
        the decorator above the route decorator, a route any of whose methods is not guarded
        (a WebSocket route, a route serving POST and PUT), options that do not fit the
        middleware's (a lock longer than the retention)."""
        problems = [problem for problem, _ in self._problems(routes, methods)]
        if problems:
            raise ConfigurationError("\n".join(problems))

    def unguarded(self, routes: Iterable[BaseRoute], methods: frozenset[str]) -> str | None:
        """What :meth:`check` refuses that would run a decorated handler unguarded for an
        unsafe method (a ``PUT`` the middleware does not guard), if anything: refused at every
        request of an app whose lifespan did not run (a mounted app's)."""
        problems = [problem for problem, unguarded in self._problems(routes, methods) if unguarded]
        return "\n".join(problems) if problems else None

    def _problems(
        self, routes: Iterable[BaseRoute], methods: frozenset[str]
    ) -> Iterator[tuple[str, bool]]:
        """Each problem :meth:`check` refuses, and whether it leaves an unsafe method of a
        decorated handler unguarded."""
        named: dict[tuple[str, str], str] = {}  # (method, operation): the template it names
        for entry in iter_routes(routes):
            wrapper, overrides = decoration(entry.handler)
            if overrides is None:
                continue
            operation: str = getattr(wrapper, OPERATION_ATTRIBUTE, None) or ""
            for method in sorted(entry.methods & methods) if operation else ():
                other = named.setdefault((method, operation), entry.template)
                if other != entry.template:
                    # One key for two routes: each would answer the other's requests.
                    yield (
                        f"@idempotent(operation={operation!r}) names two routes, {method} "
                        f"{other} and {method} {entry.template}: they would share records. "
                        f"Give each its own operation",
                        False,
                    )
            unsafe = not (entry.methods - methods).issubset(_SAFE_METHODS)
            if wrapper is None:
                yield str(misplaced_decorator_error(entry.template)), False
            elif isinstance(entry.route, WebSocketRoute) or (
                entry.methods and entry.methods.isdisjoint(methods)
            ):
                served = ", ".join(sorted(entry.methods)) or "WebSocket"
                yield (
                    f"@idempotent on {entry.template} ({served}) does nothing: the middleware "
                    f"guards {', '.join(sorted(methods))} requests only. Add the method to "
                    f"IdempotencyMiddleware(methods=...), or remove @idempotent",
                    unsafe,
                )
            elif entry.methods - methods:
                # One handler serving a guarded and an unguarded method (POST and PUT): its
                # unguarded requests would run it twice for one key, with no word.
                unguarded = ", ".join(sorted(entry.methods - methods))
                yield (
                    f"@idempotent on {entry.template} serves {', '.join(sorted(entry.methods))}, "
                    f"but the middleware guards {', '.join(sorted(methods))} requests only: its "
                    f"{unguarded} requests would run unguarded. Split the route (one route per "
                    f"method, @idempotent on the guarded ones), or guard the method: "
                    f"IdempotencyMiddleware(methods=[...]) with {unguarded} added",
                    unsafe,
                )
            else:
                try:
                    self._defaults.merged(overrides)
                except ConfigurationError as exc:
                    yield f"@idempotent on {entry.template}: {exc}", False

    def policy_for(self, handler: object) -> IdempotencyPolicy | None:
        """The merged policy of a route with this handler, or ``None`` when it is not guarded
        (as :meth:`resolve` decides it, minus the checks that raise on a misplaced decorator)."""
        overrides = decoration(handler)[1]
        if overrides is None and not self._protect_all:
            return None
        return self._defaults.merged(overrides or {})

    def _locate(self, scope: Scope, app: ASGIApp) -> _Leaf | None:
        """The route ``scope`` reaches in ``app``, the app the middleware wraps.

        Where no router is found (:func:`_router_for`), the route named in the scope is used
        instead, but only once its own stack is seen to hold ``app``.
        """
        below = _router_for(scope, app)
        if below is not None:
            return find_leaf(below.routes, below.scope_for(scope))
        route = scope.get("route")
        if (
            isinstance(route, BaseRoute)
            and not isinstance(route, Mount | Host)
            and _wraps(getattr(route, "app", None), app)
        ):
            endpoint = scope.get("endpoint", getattr(route, "endpoint", None))
            return _Leaf(route, endpoint, str(getattr(route, "path", "")))
        if not self._warned_unrouted:
            self._warned_unrouted = True
            logger.warning(
                "IdempotencyMiddleware finds no router below %r: its requests pass through "
                "unguarded. Wrap a Starlette or FastAPI app, or add the middleware to one.",
                app,
            )
        return None

    def _guarded_route(self, leaf: _Leaf, method: str) -> GuardedRoute | None:
        handler = endpoint_handler(leaf.endpoint, method)
        wrapper, overrides = decoration(handler)
        if overrides is None and not self._protect_all:
            return None
        marks_start = wrapper is not None
        if overrides is not None and not marks_start:
            raise misplaced_decorator_error(leaf.template)
        policy = self._defaults.merged(overrides or {})
        command = None
        if policy.fingerprint == "validated":
            from starlette_idempotency._command_fingerprint import fingerprinter_for_route

            # The body FastAPI validates: an inclusion's dependencies may embed it.
            command = fingerprinter_for_route(
                leaf.effective or leaf.route, policy.excluded_field_names
            )
            if command is None:
                logger.warning(
                    "fingerprint='validated' on %s, which has no FastAPI body model: "
                    "fingerprinting its raw body instead",
                    leaf.template,
                )
        return GuardedRoute(
            template=leaf.template,
            policy=policy,
            marks_start=marks_start,
            fingerprint_version=fingerprint_version(
                "validated" if command else "raw", policy.fingerprint_version
            ),
            handler=handler if wrapper is None else wrapper,
            operation=getattr(wrapper, OPERATION_ATTRIBUTE, None),
            command=command,
            # A bound method calls its function, the wrapper, in the request's own context.
            decorated_above=wrapper is not None
            and wrapper is not getattr(handler, "__func__", handler),
        )
