"""Route lists that change after the first request: the next request follows the new routes."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from tests.support.guarded import make_client
from tests.support.routing import Endpoints, assert_behaviour


async def test_route_inserted_ahead_of_a_served_route() -> None:
    endpoints = Endpoints()
    app = Starlette(routes=[Route("/orders", endpoints.open("old"), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    await assert_behaviour(client, "/orders", endpoints, "old", guarded=False)
    app.router.routes.insert(0, Route("/orders", endpoints.guarded("new"), methods=["POST"]))
    await assert_behaviour(client, "/orders", endpoints, "new", guarded=True)
    app.router.routes.insert(0, Route("/orders", endpoints.open("newer"), methods=["POST"]))
    await assert_behaviour(client, "/orders", endpoints, "newer", guarded=False)


async def test_route_replaced_in_place() -> None:
    endpoints = Endpoints()
    app = Starlette(routes=[Route("/orders", endpoints.guarded("old"), methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    await assert_behaviour(client, "/orders", endpoints, "old", guarded=True)
    app.router.routes[0] = Route("/orders", endpoints.open("new"), methods=["POST"])
    await assert_behaviour(client, "/orders", endpoints, "new", guarded=False)


async def test_route_inserted_inside_a_mount() -> None:
    endpoints = Endpoints()
    shop = Mount("/shop", routes=[Route("/orders", endpoints.guarded("old"), methods=["POST"])])
    app = Starlette(routes=[shop])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    await assert_behaviour(client, "/shop/orders", endpoints, "old", guarded=True)
    shop.routes.insert(0, Route("/orders", endpoints.open("new"), methods=["POST"]))
    await assert_behaviour(client, "/shop/orders", endpoints, "new", guarded=False)


async def test_add_route_after_the_first_request() -> None:
    endpoints = Endpoints()
    app = Starlette(routes=[Route("/{anything}", endpoints.open("fallback"), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    assert (await client.post("/late/x")).status_code == 404
    app.add_route("/late/x", endpoints.guarded("late"), methods=["POST"])
    await assert_behaviour(client, "/late/x", endpoints, "late", guarded=True)
    await assert_behaviour(client, "/other", endpoints, "fallback", guarded=False)


async def test_include_router_after_the_first_request() -> None:
    endpoints = Endpoints()
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    assert (await client.post("/api/v1/items")).status_code == 404
    inner = APIRouter(prefix="/v1")
    inner.add_api_route("/items", endpoints.guarded("item"), methods=["POST"])
    outer = APIRouter()
    outer.include_router(inner)
    app.include_router(outer, prefix="/api")
    await assert_behaviour(client, "/api/v1/items", endpoints, "item", guarded=True)


async def test_routes_added_to_an_included_router_after_the_first_request() -> None:
    """FastAPI includes routers lazily: a route added to one already included is live."""
    endpoints = Endpoints()
    inner = APIRouter(prefix="/v1")
    inner.add_api_route("/items", endpoints.open("old"), methods=["POST"])
    outer = APIRouter(prefix="/api")
    outer.include_router(inner)
    app = FastAPI()
    app.include_router(outer)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    await assert_behaviour(client, "/api/v1/items", endpoints, "old", guarded=False)
    assert (await client.post("/api/v1/orders")).status_code == 404
    inner.add_api_route("/orders", endpoints.guarded("orders"), methods=["POST"])
    await assert_behaviour(client, "/api/v1/orders", endpoints, "orders", guarded=True)
    late = APIRouter(prefix="/v2")
    late.add_api_route("/items", endpoints.guarded("v2"), methods=["POST"])
    outer.include_router(late)
    await assert_behaviour(client, "/api/v2/items", endpoints, "v2", guarded=True)
    await assert_behaviour(client, "/api/v1/items", endpoints, "old", guarded=False)
