"""Route lookup on everything Starlette matches on: host, ``root_path``, mounts, path params,
in whichever order the requests come."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Host, Mount, Route, Router
from starlette.types import ASGIApp

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from tests.support.guarded import make_client
from tests.support.routing import Endpoint, Endpoints, assert_behaviour

Placement = Callable[[Starlette], ASGIApp]


def added(app: Starlette) -> ASGIApp:
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    return app


def wrapped(app: Starlette) -> ASGIApp:
    return IdempotencyMiddleware(app, store=MemoryStore())


@pytest.fixture(params=[added, wrapped], ids=["add_middleware", "wrapped"])
def place(request: pytest.FixtureRequest) -> Placement:
    placement: Placement = request.param
    return placement


ORDERS = [["api", "admin"], ["admin", "api"]]


def orders_host(host: str, endpoint: Endpoint) -> Host:
    """``POST /orders`` answered by ``endpoint`` on the host (pattern) ``host``."""
    return Host(host, Router([Route("/orders", endpoint, methods=["POST"])]))


@pytest.mark.parametrize("order", ORDERS, ids=["api-first", "admin-first"])
async def test_two_hosts_serving_one_path(place: Placement, order: list[str]) -> None:
    endpoints = Endpoints()
    app = Starlette(
        routes=[
            orders_host("api.example", endpoints.guarded("api")),
            orders_host("admin.example", endpoints.open("admin")),
        ]
    )
    client = make_client(place(app))
    for _ in range(2):
        for host in order:
            url = f"http://{host}.example/orders"
            await assert_behaviour(client, url, endpoints, host, guarded=host == "api")


@pytest.mark.parametrize("order", ORDERS, ids=["api-first", "admin-first"])
async def test_host_pattern_ahead_of_a_catch_all_host(order: list[str]) -> None:
    endpoints = Endpoints()
    app = Starlette(
        routes=[
            orders_host("{tenant}.api.example", endpoints.guarded("api")),
            Mount("", routes=[Route("/orders", endpoints.open("admin"), methods=["POST"])]),
        ]
    )
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    urls = {"api": "http://acme.api.example:8443/orders", "admin": "http://admin.example/orders"}
    for host in order:
        await assert_behaviour(client, urls[host], endpoints, host, guarded=host == "api")


@pytest.mark.parametrize("order", ORDERS, ids=["api-first", "admin-first"])
async def test_hosts_inside_an_included_router_with_a_prefix(order: list[str]) -> None:
    endpoints = Endpoints()
    api = APIRouter()
    api.add_api_route("/orders", endpoints.guarded("api"), methods=["POST"])
    admin = APIRouter()
    admin.add_api_route("/orders", endpoints.open("admin"), methods=["POST"])
    by_host = APIRouter()
    by_host.host("api.example", api)
    by_host.host("admin.example", admin)
    app = FastAPI()
    app.include_router(by_host, prefix="/v1")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    for host in order:
        url = f"http://{host}.example/v1/orders"
        await assert_behaviour(client, url, endpoints, host, guarded=host == "api")


@pytest.mark.parametrize("order", [["/1", "/a"], ["/a", "/1"]])
async def test_path_params_pick_the_route(order: list[str]) -> None:
    endpoints = Endpoints()
    app = Starlette(
        routes=[
            Mount(
                "/t/{tenant}",
                routes=[
                    Route("/items/{n:int}", endpoints.guarded("number"), methods=["POST"]),
                    Route("/items/{name}", endpoints.open("name"), methods=["POST"]),
                ],
            )
        ]
    )
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    for tenant in ("acme", "other"):
        for item in order:
            name = "number" if item == "/1" else "name"
            url = f"/t/{tenant}/items{item}"
            await assert_behaviour(client, url, endpoints, name, guarded=name == "number")


async def test_middleware_inside_a_mount_under_a_server_root_path() -> None:
    """The middleware sees the scope below the mount (its ``root_path`` holds ``/api/shop``)
    while ``scope["app"]`` is still the outer app, whose routes sit above that scope."""
    endpoints = Endpoints()
    shop = Mount(
        "/shop",
        routes=[
            Route("/orders", endpoints.guarded("shop"), methods=["POST"]),
            Route("/notes", endpoints.open("notes"), methods=["POST"]),
        ],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    app = Starlette(routes=[shop, Route("/orders", endpoints.open("top"), methods=["POST"])])
    transport = httpx.ASGITransport(app=app, root_path="/api")
    client = httpx.AsyncClient(transport=transport, base_url="http://testserver")
    await assert_behaviour(client, "/api/shop/orders", endpoints, "shop", guarded=True)
    await assert_behaviour(client, "/api/shop/notes", endpoints, "notes", guarded=False)
    await assert_behaviour(client, "/api/orders", endpoints, "top", guarded=False)


@pytest.mark.parametrize(
    "root_paths", [["/api", ""], ["", "/api"]], ids=["api-first", "bare-first"]
)
async def test_one_path_under_two_server_root_paths(
    place: Placement, root_paths: list[str]
) -> None:
    """``/api/shop/orders`` is ``/shop/orders`` under the root path ``/api``, and a different
    route without it."""
    endpoints = Endpoints()
    app = Starlette(
        routes=[
            Mount("/shop", routes=[Route("/orders", endpoints.guarded("shop"), methods=["POST"])]),
            Mount("/api", routes=[Route("/shop/orders", endpoints.open("api"), methods=["POST"])]),
        ]
    )
    guarded_app = place(app)
    for root_path in root_paths:
        transport = httpx.ASGITransport(app=guarded_app, root_path=root_path)
        client = httpx.AsyncClient(transport=transport, base_url="http://testserver")
        name = "shop" if root_path else "api"
        await assert_behaviour(client, "/api/shop/orders", endpoints, name, guarded=bool(root_path))
