"""Where the middleware sits: several apps, sub-apps with their own middleware, per-route
middleware. Each instance matches against the routes of the app it wraps."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client
from tests.support.routing import Endpoints, assert_behaviour


async def test_two_apps_each_with_its_own_middleware_instance() -> None:
    endpoints = Endpoints()
    store = MemoryStore()  # shared too: the route template keeps their keys apart
    first = Starlette(routes=[Route("/orders", endpoints.guarded("first"), methods=["POST"])])
    second = Starlette(routes=[Route("/orders", endpoints.open("second"), methods=["POST"])])
    for app in (first, second):
        app.add_middleware(IdempotencyMiddleware, store=store)
    clients = {"first": make_client(first), "second": make_client(second)}
    for name in itertools.chain(["first", "second"], ["second", "first"]):
        await assert_behaviour(clients[name], "/orders", endpoints, name, guarded=name == "first")


def sub_app(endpoints: Endpoints) -> Starlette:
    return Starlette(
        routes=[
            Route("/orders/{id}", endpoints.guarded("sub"), methods=["POST"]),
            Route("/notes", endpoints.open("sub-notes"), methods=["POST"]),
        ]
    )


async def check_sub_app(app: ASGIApp, endpoints: Endpoints) -> None:
    client = make_client(app)
    await assert_behaviour(client, "/shop/orders/3", endpoints, "sub", guarded=True)
    await assert_behaviour(client, "/shop/notes", endpoints, "sub-notes", guarded=False)
    await assert_behaviour(client, "/orders/3", endpoints, "parent", guarded=False)


def parent_of(mounted: ASGIApp | list[BaseRoute], endpoints: Endpoints) -> Starlette:
    shop = Mount("/shop", routes=mounted) if isinstance(mounted, list) else Mount("/shop", mounted)
    return Starlette(
        routes=[
            shop,
            Route("/orders/{id}", endpoints.open("parent"), methods=["POST"]),
        ]
    )


async def test_sub_app_with_its_middleware_added_mounted_in_a_parent() -> None:
    endpoints = Endpoints()
    sub = sub_app(endpoints)
    sub.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    await check_sub_app(parent_of(sub, endpoints), endpoints)


async def test_sub_app_wrapped_directly_and_mounted_in_a_parent() -> None:
    """``scope["app"]`` is the parent here, and the parent's ``Mount.routes`` is empty: the
    middleware still guards the routes of the app it wraps."""
    endpoints = Endpoints()
    mounted = IdempotencyMiddleware(sub_app(endpoints), store=MemoryStore())
    await check_sub_app(parent_of(mounted, endpoints), endpoints)


@pytest.mark.parametrize("status", [201, 402])
async def test_a_guarded_sub_app_mounted_in_a_guarded_parent_is_guarded_once(
    status: int,
) -> None:
    """Two pods, each a parent guarded on the shared store mounting a sub-app guarded on a
    store of its process: the parent's guard owns the key, and the sub-app's passes the
    request on. A second guard marked the endpoint's start on its own lease alone, so the
    parent's took every outcome for one from before the endpoint and freed the key: a retry
    on the other pod ran the handler again."""
    runs = 0

    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        return JSONResponse({"run": runs}, status_code=status)

    shared = MemoryStore()

    def pod() -> Starlette:
        sub = Starlette(routes=[Route("/pay", idempotent()(pay), methods=["POST"])])
        sub.add_middleware(IdempotencyMiddleware, store=MemoryStore())
        parent = Starlette(routes=[Mount("/sub", sub)])
        parent.add_middleware(IdempotencyMiddleware, store=shared)
        return parent

    headers = {"Idempotency-Key": "k"}
    first = await make_client(pod()).post("/sub/pay", headers=headers)
    retry = await make_client(pod()).post("/sub/pay", headers=headers)
    assert (first.status_code, retry.status_code) == (status, status)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert runs == 1


async def test_a_request_to_itself_from_a_guarded_handler_is_guarded_on_its_own() -> None:
    """A handler that calls another guarded route of its app in process (an ASGI client):
    that request has a scope of its own, and its own guard, though it runs in the task of
    the guarded request that made it."""
    runs: Counter[str] = Counter()

    @idempotent()
    async def inner(request: Request) -> Response:
        runs["inner"] += 1
        return JSONResponse({"inner": runs["inner"]}, status_code=201)

    @idempotent()
    async def outer(request: Request) -> Response:
        runs["outer"] += 1
        itself = make_client(request.app)
        headers = {"Idempotency-Key": "inner-key"}
        answers = [(await itself.post("/inner", headers=headers)).json() for _ in range(2)]
        return JSONResponse(answers, status_code=201)

    app = Starlette(
        routes=[Route("/outer", outer, methods=["POST"]), Route("/inner", inner, methods=["POST"])]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    answer = await make_client(app).post("/outer", headers={"Idempotency-Key": "k"})
    assert answer.json() == [{"inner": 1}, {"inner": 1}]
    assert runs == Counter(outer=1, inner=1)


class Passthrough:
    """Any middleware that keeps what it wraps as ``.app``, as Starlette's own do."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


async def test_parent_middleware_sees_through_a_wrapped_mounted_app() -> None:
    """``Mount.routes`` is empty when the mounted app is wrapped, yet the router dispatches
    through the wrapper to the routes below it."""
    endpoints = Endpoints()
    parent = parent_of(Passthrough(sub_app(endpoints)), endpoints)
    parent.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    await check_sub_app(parent, endpoints)


@pytest.mark.parametrize("as_app", [True, False], ids=["mounted-app", "mounted-routes"])
async def test_route_with_its_own_middleware_inside_a_mount(as_app: bool) -> None:
    endpoints = Endpoints()
    guarded = Route(
        "/orders/{id}",
        endpoints.guarded("sub"),
        methods=["POST"],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    notes = Route("/notes", endpoints.open("sub-notes"), methods=["POST"])
    routes: list[BaseRoute] = [guarded, notes]
    parent = parent_of(Starlette(routes=routes) if as_app else routes, endpoints)
    await check_sub_app(parent, endpoints)


class PlainFunctionMiddleware:
    """A middleware that hides what it wraps (no ``.app``), as a closure would."""

    def __init__(self, app: ASGIApp) -> None:
        async def call(scope: Scope, receive: Receive, send: Send) -> None:
            await app(scope, receive, send)

        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.call(scope, receive, send)


async def test_middleware_above_one_that_hides_the_app_it_wraps() -> None:
    endpoints = Endpoints()
    sub = sub_app(endpoints)
    sub.add_middleware(PlainFunctionMiddleware)
    sub.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    await check_sub_app(parent_of(sub, endpoints), endpoints)


@pytest.mark.filterwarnings("ignore:The `root_path` parameter is deprecated")
async def test_fastapi_root_path_with_the_middleware_wrapping_it() -> None:
    """FastAPI sets its ``root_path`` in its own ``__call__``, below a wrapping middleware."""
    endpoints = Endpoints()
    app = FastAPI(root_path="/api")
    app.add_api_route("/orders", endpoints.guarded("orders"), methods=["POST"])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    await assert_behaviour(client, "/api/orders", endpoints, "orders", guarded=True)
    await assert_behaviour(client, "/orders", endpoints, "orders", guarded=True)


async def test_fastapi_sub_app_with_included_routers_mounted_in_a_fastapi_parent() -> None:
    endpoints = Endpoints()
    items = APIRouter(prefix="/items")
    items.add_api_route("/{id}", endpoints.guarded("item"), methods=["POST"])
    items.add_api_route("/{id}/notes", endpoints.open("notes"), methods=["POST"])
    v1 = APIRouter(prefix="/v1")
    v1.include_router(items)
    sub = FastAPI()
    sub.include_router(v1, prefix="/api")
    sub.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    parent = FastAPI()
    parent.add_api_route("/api/v1/items/{id}", endpoints.open("parent"), methods=["POST"])
    parent.mount("/shop", sub)
    client = make_client(parent)
    await assert_behaviour(client, "/shop/api/v1/items/3", endpoints, "item", guarded=True)
    await assert_behaviour(client, "/shop/api/v1/items/3/notes", endpoints, "notes", guarded=False)
    await assert_behaviour(client, "/api/v1/items/3", endpoints, "parent", guarded=False)


async def test_no_router_below_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[str] = []

    async def bare(scope: Scope, receive: Receive, send: Send) -> None:
        runs.append(scope["path"])
        await JSONResponse({})(scope, receive, send)

    client = make_client(IdempotencyMiddleware(bare, store=MemoryStore()))
    for _ in range(2):
        assert (await client.post("/orders")).status_code == 200
    assert runs == ["/orders", "/orders"]
    unrouted = [r for r in caplog.records if "finds no router" in r.getMessage()]
    assert len(unrouted) == 1
