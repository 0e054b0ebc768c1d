"""Finding the route a request will reach, before the app runs, and its idempotency policy.

The middleware must decide before the endpoint runs, so it repeats the router's matching:
the first FULL match wins, ``Mount`` and ``Host`` are entered with their prefix joined into
the template, and FastAPI's lazily included routers (``include_router`` since FastAPI 0.13x)
are entered through their effective routes. The per-route result is cached, keyed by the route
object and its template, never by the raw path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
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
    inner_scope = {**scope, **child_scope}
    inner_prefix = prefix + route.path if isinstance(route, Mount) else prefix
    return find_leaf(route.routes, inner_scope, inner_prefix)


def find_routes(scope: Scope, app: ASGIApp) -> Sequence[BaseRoute] | None:
    """The routes of the app this request goes to.

    Starlette puts itself in ``scope["app"]`` before its middleware runs; a middleware that wraps
    an app directly finds the router by following ``.app`` attributes down the stack.
    """
    candidate: Any = scope.get("app")
    if candidate is None:
        candidate = app
        while candidate is not None and not hasattr(candidate, "routes"):
            candidate = getattr(candidate, "app", None)
    routes: Sequence[BaseRoute] | None = getattr(candidate, "routes", None)
    return routes


class RouteResolver:
    """Maps a request to its :class:`GuardedRoute` (or ``None`` when it is not guarded)."""

    def __init__(self, defaults: IdempotencyPolicy, *, protect_all: bool) -> None:
        self._defaults = defaults
        self._protect_all = protect_all
        self._cache: dict[tuple[int, str], tuple[BaseRoute, GuardedRoute | None]] = {}
        # Routes without path parameters have exactly one path: those skip the matching.
        # Keyed by the path of a route that matched, so it holds at most one entry per static
        # route and method; a path that matched nothing is never remembered.
        self._static: dict[tuple[int, str, str, str], GuardedRoute | None] = {}

    def resolve(self, scope: Scope, app: ASGIApp) -> GuardedRoute | None:
        routes = find_routes(scope, app)
        if not routes:
            return None
        static_key = (id(routes), scope["method"], scope["path"], scope.get("root_path", ""))
        if static_key in self._static:
            return self._static[static_key]
        leaf = find_leaf(routes, dict(scope))
        if leaf is None:
            return None
        cache_key = (id(leaf.route), leaf.template)
        cached = self._cache.get(cache_key)
        if cached is not None and cached[0] is leaf.route:
            guarded = cached[1]
        else:
            guarded = self._guard(leaf)
            if len(self._cache) >= _MAX_CACHED_ROUTES:
                self._cache.clear()
            self._cache[cache_key] = (leaf.route, guarded)
        if "{" not in leaf.template and len(self._static) < _MAX_CACHED_ROUTES:
            self._static[static_key] = guarded
        return guarded

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
