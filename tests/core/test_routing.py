"""Route lookup: included routers, mounts, direct wrapping, the bounded per-route cache."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import Scope

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from starlette_idempotency._routing import RouteResolver
from tests.support.guarded import make_client
from tests.support.routing import Endpoint, Endpoints, assert_behaviour


def stored_templates(store: MemoryStore) -> set[str]:
    """The route template part of each stored key (``...:METHOD:template:key``, escaped)."""
    return {key.split(":")[-2] for key in store.records()}


async def guarded_templates(app: Starlette, url: str, endpoints: Endpoints, name: str) -> set[str]:
    """Add the middleware to ``app``, check that ``url`` reaches the guarded endpoint ``name``,
    and return the route templates its keys were stored under."""
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    await assert_behaviour(make_client(app), url, endpoints, name, guarded=True)
    return stored_templates(store)


async def test_nested_include_router() -> None:
    endpoints = Endpoints()
    app = FastAPI()
    outer = APIRouter(prefix="/api")
    inner = APIRouter(prefix="/v1")
    inner.add_api_route("/items/{item_id}", endpoints.guarded("item"), methods=["POST"])
    outer.include_router(inner)
    app.include_router(outer)
    templates = await guarded_templates(app, "/api/v1/items/7", endpoints, "item")
    assert templates == {"/api/v1/items/%7Bitem_id%7D"}


async def test_mounted_sub_app_joins_the_prefix() -> None:
    endpoints = Endpoints()
    sub = Starlette(routes=[Route("/orders/{id}", endpoints.guarded("order"), methods=["POST"])])
    app = Starlette(routes=[Mount("/shop", app=sub)])
    templates = await guarded_templates(app, "/shop/orders/3", endpoints, "order")
    assert templates == {"/shop/orders/%7Bid%7D"}


async def test_middleware_wrapping_the_app_directly() -> None:
    endpoints = Endpoints()
    inner = Starlette(
        routes=[Mount("/m", routes=[Route("/x", endpoints.guarded("x"), methods=["POST"])])]
    )
    app = IdempotencyMiddleware(inner, store=MemoryStore())
    await assert_behaviour(make_client(app), "/m/x", endpoints, "x", guarded=True)


async def test_first_full_match_wins() -> None:
    endpoints = Endpoints()
    app = Starlette(
        routes=[
            Route("/same", endpoints.open("get"), methods=["GET"]),  # PARTIAL for POST: skipped
            Route("/same", endpoints.guarded("first"), methods=["POST"]),
            Route("/same", endpoints.open("never"), methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    await assert_behaviour(make_client(app), "/same", endpoints, "first", guarded=True)
    assert endpoints.runs == Counter({"first": 1})


async def test_protect_all_guards_undecorated_routes() -> None:
    endpoints = Endpoints()
    app = FastAPI()
    app.add_api_route("/open", endpoints.open("open"), methods=["POST"])

    @app.get("/read")
    async def read() -> dict[str, int]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), protect_all=True)
    client = make_client(app)
    await assert_behaviour(client, "/open", endpoints, "open", guarded=True)
    assert (await client.get("/read")).status_code == 200


async def test_policy_lookup_is_cached_per_route_not_per_path() -> None:
    endpoints = Endpoints()
    app = Starlette(routes=[Route("/items/{n:int}", endpoints.guarded("item"), methods=["POST"])])
    middleware = IdempotencyMiddleware(app, store=MemoryStore())
    client = make_client(middleware)
    for n in range(20):
        await client.post(f"/items/{n}", headers={"Idempotency-Key": "k"})
    resolver: RouteResolver = middleware._resolver
    assert len(resolver._cache) == 1


async def test_one_route_object_mounted_under_two_prefixes_keeps_both_templates() -> None:
    endpoints = Endpoints()
    shared = Route("/orders", endpoints.guarded("order"), methods=["POST"])
    app = Starlette(routes=[Mount("/a", routes=[shared]), Mount("/b", routes=[shared])])
    store = MemoryStore()
    client = make_client(IdempotencyMiddleware(app, store=store))
    await assert_behaviour(client, "/a/orders", endpoints, "order", guarded=True)
    await assert_behaviour(client, "/b/orders", endpoints, "order", guarded=True)
    assert stored_templates(store) == {"/a/orders", "/b/orders"}


class HeaderRoute(BaseRoute):
    """A custom route on one path that picks its endpoint by a request header."""

    def __init__(self, path: str, by_variant: dict[str, Endpoint]) -> None:
        self.path = path
        self.by_variant = by_variant

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        variant = dict(scope["headers"]).get(b"x-variant", b"").decode()
        if scope["path"] != self.path or variant not in self.by_variant:
            return Match.NONE, {}
        return Match.FULL, {"endpoint": self.by_variant[variant]}

    async def handle(self, scope: Scope, receive: object, send: object) -> None:
        await Route(self.path, scope["endpoint"], methods=["POST"])(scope, receive, send)  # type: ignore[arg-type]


async def test_custom_route_matching_on_a_header_is_resolved_per_request() -> None:
    endpoints = Endpoints()
    by_variant = {"safe": endpoints.guarded("safe"), "free": endpoints.open("free")}
    app = Starlette(routes=[HeaderRoute("/orders", by_variant)])
    middleware = IdempotencyMiddleware(app, store=MemoryStore())
    for order in (["safe", "free"], ["free", "safe"]):
        for variant in order:
            client = make_client(middleware)
            client.headers["x-variant"] = variant
            await assert_behaviour(client, "/orders", endpoints, variant, guarded=variant == "safe")
