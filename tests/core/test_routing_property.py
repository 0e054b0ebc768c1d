"""Property: the middleware guards exactly the requests whose dispatched endpoint is decorated,
refuses those it cannot see, and never lets two requests the app tells apart share a record.

For a generated route tree (routes held as functions, partials or ``HTTPEndpoint`` classes;
mounts, mounted apps, apps mounted whole with no router to see into, hosts and host patterns;
included routers) and a generated sequence of requests and route-list changes, each request is
first sent to the bare router, which tells which endpoint really runs; then through the
middleware, where a decorated endpoint must run once for a retried key and demand a key (or,
inside an app the middleware cannot see into, be refused without running), and any other must
behave exactly as it did without the middleware. Then one key goes to the same path on every
host: a replay answers only a request that reaches the very endpoint (on the very host, for an
endpoint under a ``Host`` route) whose answer it is.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Host, Mount, Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, UnguardedRequestError
from tests.support.guarded import make_client, unguarded
from tests.support.routing import EndpointKind, Endpoints

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class RouteSpec:
    path: str
    methods: tuple[str, ...]
    guarded: bool
    kind: EndpointKind = "function"


@dataclass(frozen=True)
class MountSpec:
    path: str
    children: tuple[Spec, ...]
    as_app: bool
    opaque: bool = False  # an app mounted whole, with no router the middleware can see


@dataclass(frozen=True)
class HostSpec:
    host: str
    children: tuple[Spec, ...]


Spec = RouteSpec | MountSpec | HostSpec


@dataclass(frozen=True)
class Call:
    """A POST to ``path`` on ``host``."""

    host: str
    path: str


@dataclass(frozen=True)
class RouterSpec:
    """A FastAPI router: its prefix, its routes, and routers it includes (with a prefix)."""

    prefix: str
    routes: tuple[RouteSpec, ...]
    included: tuple[tuple[RouterSpec, str], ...]


def route_path(segments: list[str]) -> str:
    """``/{x}`` and ``/{n:int}`` segments, their names numbered so that none repeats."""
    return "".join(re.sub(r"\{(\w+)", rf"{{\g<1>{i}", seg) for i, seg in enumerate(segments))


segments = st.sampled_from(["/a", "/b", "/{x}", "/{n:int}"])
route_specs = st.builds(
    RouteSpec,
    st.lists(segments, min_size=1, max_size=2).map(route_path),
    st.sampled_from([("POST",), ("GET",), ("GET", "POST")]),
    st.booleans(),
    st.sampled_from(["function", "partial", "class"]),
)


def containers(children: st.SearchStrategy[Spec]) -> st.SearchStrategy[Spec]:
    kids = st.lists(children, min_size=1, max_size=4).map(tuple)
    mounts = st.builds(
        MountSpec,
        st.sampled_from(["/a", "/b", "/{t}"]),
        kids,
        st.booleans(),
        st.integers(0, 4).map(lambda draw: draw == 0),
    )
    plain_mounts = st.builds(MountSpec, st.just(""), kids, st.booleans())
    hosts = st.builds(HostSpec, st.sampled_from(["api.example", "{sub}.example"]), kids)
    return mounts | plain_mounts | hosts


trees = st.lists(st.recursive(route_specs, containers, max_leaves=10), min_size=1, max_size=5)
router_specs = st.recursive(
    st.builds(
        RouterSpec,
        st.sampled_from(["", "/a"]),
        st.lists(route_specs, max_size=3).map(tuple),
        st.just(()),
    ),
    lambda children: st.builds(
        RouterSpec,
        st.sampled_from(["", "/a", "/b"]),
        st.lists(route_specs, max_size=3).map(tuple),
        st.lists(st.tuples(children, st.sampled_from(["", "/a", "/{t}"])), max_size=3).map(tuple),
    ),
    max_leaves=6,
)
HOSTS = ["api.example", "admin.example", "other.test"]


def concrete(template: str) -> list[str]:
    """Request paths for a template: every parameter ``1``, or every parameter ``z``."""
    return [re.sub(r"\{[^}]*\}", value, template) for value in ("1", "z")]


def tree_paths(spec: Spec, prefix: str = "") -> list[str]:
    """Request paths that reach the routes of ``spec`` (on some host)."""
    if isinstance(spec, RouteSpec):
        return concrete(prefix + spec.path)
    inner = prefix + spec.path if isinstance(spec, MountSpec) else prefix
    return [path for child in spec.children for path in tree_paths(child, inner)]


def router_paths(spec: RouterSpec, prefix: str = "") -> list[str]:
    """Request paths that reach the routes of an included router (route paths hold the prefix
    of their own router, as ``add_api_route`` makes them)."""
    paths = [path for route in spec.routes for path in concrete(prefix + spec.prefix + route.path)]
    for child, included_at in spec.included:
        paths += router_paths(child, prefix + spec.prefix + included_at)
    return paths


def opaque(app: ASGIApp) -> ASGIApp:
    """``app`` behind a function: no ``.app`` and no ``.routes`` for the middleware to follow."""

    async def mounted(scope: Scope, receive: Receive, send: Send) -> None:
        await app(scope, receive, send)

    return mounted


@dataclass
class Builder:
    """Turns specs into routes whose endpoints count their runs under unique names, and notes
    which are decorated, which the middleware cannot see, and which sit under a ``Host``."""

    endpoints: Endpoints = field(default_factory=Endpoints)
    guarded: set[str] = field(default_factory=set)
    hidden: set[str] = field(default_factory=set)
    under_host: set[str] = field(default_factory=set)
    names: itertools.count[int] = field(default_factory=itertools.count)

    def endpoint(self, guarded: bool, kind: EndpointKind = "function") -> tuple[str, Any]:
        """A new endpoint's name, and what its route is given."""
        name = f"e{next(self.names)}"
        if guarded:
            self.guarded.add(name)
        return name, self.endpoints.of_kind(name, guarded=guarded, kind=kind)

    def route(self, spec: Spec, *, hidden: bool = False, hosted: bool = False) -> BaseRoute:
        if isinstance(spec, RouteSpec):
            name, endpoint = self.endpoint(spec.guarded, spec.kind)
            if hidden:
                self.hidden.add(name)
            if hosted:
                self.under_host.add(name)
            return Route(spec.path, endpoint, methods=list(spec.methods))
        hidden = hidden or (isinstance(spec, MountSpec) and spec.opaque)
        hosted = hosted or isinstance(spec, HostSpec)
        children = [self.route(child, hidden=hidden, hosted=hosted) for child in spec.children]
        if isinstance(spec, HostSpec):
            return Host(spec.host, Router(children))
        if spec.opaque:
            return Mount(spec.path, app=opaque(Starlette(routes=children)))
        return (
            Mount(spec.path, Starlette(routes=children))
            if spec.as_app
            else Mount(spec.path, routes=children)
        )

    def api_router(self, spec: RouterSpec, depth: int = 0) -> APIRouter:
        router = APIRouter(prefix=spec.prefix)
        for route in spec.routes:
            _, endpoint = self.endpoint(route.guarded)
            router.add_api_route(route.path, endpoint, methods=list(route.methods))
        for child, prefix in spec.included:
            # Included prefixes join into one path: number their parameters by depth.
            prefix = prefix.replace("{t}", f"{{t{depth}}}")
            router.include_router(self.api_router(child, depth + 1), prefix=prefix)
        return router


async def reached(router: ASGIApp, builder: Builder, url: str) -> tuple[str | None, int]:
    """The endpoint ``url`` reaches in the bare router, and the status it answers there."""
    runs = builder.endpoints.runs
    before = Counter(runs)
    bare = await make_client(unguarded(router)).post(url)
    ran = list(runs - before)
    assert len(ran) <= 1
    return (ran[0] if ran else None), bare.status_code


async def check_request(app: ASGIApp, router: ASGIApp, builder: Builder, request: Call) -> None:
    runs = builder.endpoints.runs
    url = f"http://{request.host}{request.path}"
    name, bare_status = await reached(router, builder, url)

    client = make_client(app)
    key = {"Idempotency-Key": uuid.uuid4().hex}
    before = Counter(runs)
    if name in builder.guarded and name in builder.hidden:  # refused, never run unguarded
        for _ in range(2):
            with pytest.raises(UnguardedRequestError):
                await client.post(url, headers=key)
        assert runs - before == Counter()
        return
    first = await client.post(url, headers=key)
    retry = await client.post(url, headers=key)
    keyless = await client.post(url)
    if name in builder.guarded:
        assert runs - before == Counter({name: 1})
        assert retry.headers.get("x-idempotent-replay") == "true"
        assert keyless.status_code == 400
    else:
        assert runs - before == (Counter({name: 3}) if name else Counter())
        assert [first.status_code, retry.status_code, keyless.status_code] == [bare_status] * 3


async def check_one_key_on_every_host(
    app: ASGIApp, router: ASGIApp, builder: Builder, path: str, hosts: list[str]
) -> None:
    """One key sent to ``path`` on every host: a replay only ever answers a request that
    reaches the endpoint whose answer it is, on the host that made it when that endpoint
    sits under a ``Host`` route."""
    client = make_client(app, raise_app_exceptions=False)  # refusals are 500s here
    key = {"Idempotency-Key": uuid.uuid4().hex}
    answered: dict[str, str] = {}  # endpoint -> the host whose request it answered first
    for host in hosts:
        url = f"http://{host}{path}"
        name, _ = await reached(router, builder, url)
        response = await client.post(url, headers=key)
        if response.headers.get("x-idempotent-replay") != "true":
            if name is not None and response.status_code == 200:
                answered.setdefault(name, host)
            continue
        assert response.json() == {"ran": name}, (host, path, name)
        assert name is not None
        assert name not in builder.under_host or answered[name] == host, (host, path, name)


def starlette_app(routes: list[BaseRoute], placement: str) -> tuple[ASGIApp, Router]:
    app = Starlette(routes=routes)
    if placement == "wrapped":
        return IdempotencyMiddleware(app, store=MemoryStore()), app.router
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    return app, app.router


@dataclass
class Session:
    """One generated run against ``app``, checked against ``bare`` (the same routes without
    the middleware). Each request goes to one path on every host, in a drawn order: the same
    path on two hosts is where a lookup that ignores the host goes wrong."""

    data: st.DataObject
    app: ASGIApp
    bare: ASGIApp
    builder: Builder
    paths: set[str]
    requested: list[str] = field(default_factory=list)

    def steps(self) -> Iterator[bool]:
        """Whether each step adds a route (one in four) rather than sends requests."""
        for _ in range(self.data.draw(st.integers(1, 6))):
            yield self.data.draw(st.integers(0, 3)) == 0

    async def send(self) -> None:
        path = self.data.draw(st.sampled_from(sorted(self.paths | {"/z", "/a/1/b"})))
        self.requested.append(path)
        hosts = self.data.draw(st.permutations(HOSTS))
        for host in hosts:
            await check_request(self.app, self.bare, self.builder, Call(host, path))
        await check_one_key_on_every_host(self.app, self.bare, self.builder, path, hosts)

    def new_routes(self, under: str = "") -> st.SearchStrategy[RouteSpec]:
        """Routes on any path, or on a path already requested (the one a stale lookup gets
        wrong), less the prefix ``under`` that the new route will be given."""
        served = sorted(
            {p.removeprefix(under) for p in self.requested if p.startswith(under + "/")}
        )
        if not served:
            return route_specs
        methods = route_specs.map(lambda route: route.methods)
        return route_specs | st.builds(RouteSpec, st.sampled_from(served), methods, st.booleans())


@SETTINGS
@given(trees, st.sampled_from(["added", "wrapped"]), st.data())
def test_starlette_trees(tree: list[Spec], placement: str, data: st.DataObject) -> None:
    builder = Builder()
    app, router = starlette_app([builder.route(spec) for spec in tree], placement)
    session = Session(data, app, router, builder, {p for spec in tree for p in tree_paths(spec)})

    async def run() -> None:
        for adds_route in session.steps():
            if adds_route:  # a route (or a mount, or a host) ahead of all the others
                spec = data.draw(session.new_routes() | containers(session.new_routes()))
                router.routes.insert(0, builder.route(spec))
                session.paths.update(tree_paths(spec))
            else:
                await session.send()

    asyncio.run(run())


@SETTINGS
@given(router_specs, st.sampled_from(["", "/a"]), st.data())
def test_fastapi_included_routers(spec: RouterSpec, prefix: str, data: st.DataObject) -> None:
    builder = Builder()
    top = builder.api_router(spec)
    bare, app = FastAPI(), FastAPI()  # both include ``top``, and see its later routes
    for each in (bare, app):
        each.include_router(top, prefix=prefix)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    session = Session(data, app, bare, builder, set(router_paths(spec, prefix)))

    async def run() -> None:
        for adds_route in session.steps():
            if adds_route:  # a route added to the router already included
                route = data.draw(session.new_routes(under=prefix + top.prefix))
                _, endpoint = builder.endpoint(route.guarded)
                top.add_api_route(route.path, endpoint, methods=list(route.methods))
                session.paths.update(concrete(prefix + top.prefix + route.path))
            else:
                await session.send()

    asyncio.run(run())
