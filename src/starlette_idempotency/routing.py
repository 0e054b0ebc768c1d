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
keyed by the route object, its endpoint and its full template.

The routes are those of the app the middleware wraps, found by following ``.app`` down the
stack: the scope the middleware receives is the scope that app's router will match, however
many mounts were entered above it. ``scope["app"]`` can name a parent app whose routes sit
above that scope, so it is used only when its own middleware stack holds this middleware.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Host, Match, Mount

from starlette_idempotency._types import ASGIApp, Scope
from starlette_idempotency.fingerprint import fingerprint_version
from starlette_idempotency.policy import MARKS_START_ATTRIBUTE, POLICY_ATTRIBUTE, IdempotencyPolicy

if TYPE_CHECKING:
    from starlette_idempotency.commands import CommandFingerprinter

logger = logging.getLogger(__name__)

_MAX_CACHED_ROUTES = 2048
_MAX_STACK_DEPTH = 64  # bounds the walk down ``.app`` attributes, should they ever form a cycle


@dataclass(frozen=True, slots=True)
class GuardedRoute:
    """A route the middleware guards: its template, merged policy, whether the endpoint reports
    its own start (the documented decorator order), and how its requests are fingerprinted."""

    template: str
    policy: IdempotencyPolicy
    marks_start: bool
    fingerprint_version: str
    command: CommandFingerprinter | None = None


@dataclass(frozen=True, slots=True)
class _Leaf:
    route: BaseRoute
    endpoint: Callable[..., Any] | None
    template: str


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


def find_leaf(routes: Iterable[BaseRoute], scope: Scope, prefix: str = "") -> _Leaf | None:
    """The first route that fully matches ``scope``, with its full path template."""
    for route in routes:
        if _is_included_router(route):
            match, child_scope, matched, context = _included_router_match(route, scope)
            if match is not Match.FULL:
                continue
            if _is_included_router(matched):
                return find_leaf([matched], scope, prefix)
            if isinstance(matched, Mount | Host):
                return _enter(matched, scope, child_scope, prefix)
            template = str(getattr(context, "path", None) or getattr(matched, "path", ""))
            return _Leaf(matched, child_scope.get("endpoint"), prefix + template)
        match, child_scope = route.matches(scope)
        if match is not Match.FULL:
            continue
        if isinstance(route, Mount | Host):
            return _enter(route, scope, child_scope, prefix)
        endpoint = child_scope.get("endpoint", getattr(route, "endpoint", None))
        return _Leaf(route, endpoint, prefix + getattr(route, "path", ""))
    return None


def _enter(route: Mount | Host, scope: Scope, child_scope: Scope, prefix: str) -> _Leaf | None:
    # ``Mount.routes`` is empty when the mounted app is wrapped (in IdempotencyMiddleware, say),
    # yet the router still dispatches through the wrapper to the routes below it.
    below = _routes_below(route.app) or _Routes(route.routes)
    inner_prefix = prefix + route.path if isinstance(route, Mount) else prefix
    return find_leaf(below.routes, below.scope_for({**scope, **child_scope}), inner_prefix)


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


def _routes_below(app: object) -> _Routes | None:
    """The routes of the first router found by following ``.app`` down from ``app``."""
    for node in _stack(app):
        routes: Sequence[BaseRoute] | None = getattr(node, "routes", None)
        if routes is not None:
            root_path = getattr(node, "root_path", "")
            return _Routes(routes, root_path if isinstance(root_path, str) else "")
    return None


class RouteResolver:
    """Maps a request to its :class:`GuardedRoute` (or ``None`` when it is not guarded)."""

    def __init__(self, defaults: IdempotencyPolicy, *, protect_all: bool) -> None:
        self._defaults = defaults
        self._protect_all = protect_all
        # The key holds ids; the value holds the objects themselves, so that no id in a key can
        # be reused by a new route or endpoint while the entry lives.
        self._cache: dict[tuple[int, int, str], tuple[BaseRoute, object, GuardedRoute | None]] = {}
        self._warned_unrouted = False

    def resolve(self, scope: Scope, app: ASGIApp) -> GuardedRoute | None:
        leaf = self._locate(scope, app)
        if leaf is None:
            return None
        cache_key = (id(leaf.route), id(leaf.endpoint), leaf.template)
        cached = self._cache.get(cache_key)
        if cached is not None and cached[0] is leaf.route and cached[1] is leaf.endpoint:
            return cached[2]
        guarded = self._guard(leaf)
        if len(self._cache) >= _MAX_CACHED_ROUTES:
            self._cache.clear()
        self._cache[cache_key] = (leaf.route, leaf.endpoint, guarded)
        return guarded

    def _locate(self, scope: Scope, app: ASGIApp) -> _Leaf | None:
        """The route ``scope`` reaches in ``app``, the app the middleware wraps.

        Where ``.app`` leads to no router (a plain function middleware in between, or the
        middleware given to one ``Route(middleware=...)``), the app or route named in the scope
        is used instead, but only once its own stack is seen to hold ``app``.
        """
        below = _routes_below(app)
        if below is None:
            owner = scope.get("app")
            if owner is not None and _wraps(getattr(owner, "middleware_stack", None), app):
                below = _routes_below(owner)
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

    def _guard(self, leaf: _Leaf) -> GuardedRoute | None:
        overrides = getattr(leaf.endpoint, POLICY_ATTRIBUTE, None)
        if overrides is None and not self._protect_all:
            return None
        policy = self._defaults.merged(overrides or {})
        command = None
        if policy.fingerprint == "validated":
            from starlette_idempotency.commands import fingerprinter_for_route

            command = fingerprinter_for_route(leaf.route, policy.excluded_field_names)
            if command is None:
                logger.warning(
                    "fingerprint='validated' on %s, which has no FastAPI body model: "
                    "fingerprinting its raw body instead",
                    leaf.template,
                )
        return GuardedRoute(
            template=leaf.template,
            policy=policy,
            marks_start=bool(getattr(leaf.endpoint, MARKS_START_ATTRIBUTE, False)),
            fingerprint_version=fingerprint_version(
                "validated" if command else "raw", policy.fingerprint_version
            ),
            command=command,
        )
