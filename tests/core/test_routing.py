"""Route lookup: included routers, mounts, direct wrapping, the bounded per-route cache."""

from __future__ import annotations

from collections import Counter

from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency.routing import RouteResolver
from tests.core.conftest import make_client

HEADERS = {"Idempotency-Key": "k"}


async def assert_guarded(app: object, path: str, runs: Counter[str]) -> None:
    client = make_client(app)  # type: ignore[arg-type]
    first = await client.post(path, json={}, headers=HEADERS)
    assert first.status_code == 200, first.text
    replay = await client.post(path, json={}, headers=HEADERS)
    assert replay.headers.get("x-idempotent-replay") == "true"
    assert runs[path] == 1
    assert (await client.post(path, json={})).status_code == 400


async def test_nested_include_router() -> None:
    runs: Counter[str] = Counter()
    app = FastAPI()
    outer = APIRouter(prefix="/api")
    inner = APIRouter(prefix="/v1")

    @inner.post("/items/{item_id}")
    @idempotent()
    async def create(item_id: int) -> dict[str, int]:
        runs[f"/api/v1/items/{item_id}"] += 1
        return {"item": item_id}

    outer.include_router(inner)
    app.include_router(outer)
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    await assert_guarded(app, "/api/v1/items/7", runs)
    (key,) = store._entries
    assert ":POST:/api/v1/items/%7Bitem_id%7D:k" in key


async def test_mounted_sub_app_joins_the_prefix() -> None:
    runs: Counter[str] = Counter()

    @idempotent()
    async def create(request: Request) -> Response:
        runs[request.url.path] += 1
        return JSONResponse({"ok": True})

    sub = Starlette(routes=[Route("/orders/{order_id}", create, methods=["POST"])])
    app = Starlette(routes=[Mount("/shop", app=sub)])
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    await assert_guarded(app, "/shop/orders/3", runs)
    (key,) = store._entries
    assert ":POST:/shop/orders/%7Border_id%7D:k" in key


async def test_middleware_wrapping_the_app_directly() -> None:
    runs: Counter[str] = Counter()

    @idempotent()
    async def create(request: Request) -> Response:
        runs[request.url.path] += 1
        return JSONResponse({"ok": True})

    inner = Starlette(routes=[Mount("/m", routes=[Route("/x", create, methods=["POST"])])])
    app = IdempotencyMiddleware(inner, store=MemoryStore())
    await assert_guarded(app, "/m/x", runs)


async def test_first_full_match_wins() -> None:
    runs: Counter[str] = Counter()

    async def plain(request: Request) -> Response:
        runs["plain"] += 1
        return JSONResponse({})

    @idempotent()
    async def guarded(request: Request) -> Response:
        runs["guarded"] += 1
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/same", plain, methods=["GET"]),  # PARTIAL for POST: skipped
            Route("/same", guarded, methods=["POST"]),
            Route("/same", plain, methods=["POST"]),  # never reached
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    for _ in range(2):
        await client.post("/same", headers=HEADERS)
    assert runs == Counter({"guarded": 1})


async def test_protect_all_guards_undecorated_routes() -> None:
    runs: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/open")
    async def open_route() -> dict[str, int]:
        runs["/open"] += 1
        return {"n": runs["/open"]}

    @app.get("/read")
    async def read() -> dict[str, int]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), protect_all=True)
    await assert_guarded(app, "/open", runs)
    assert (await make_client(app).get("/read")).status_code == 200


async def test_policy_lookup_is_cached_per_route_not_per_path() -> None:
    @idempotent()
    async def create(request: Request) -> Response:
        return JSONResponse({})

    app = Starlette(routes=[Route("/items/{n:int}", create, methods=["POST"])])
    middleware = IdempotencyMiddleware(app, store=MemoryStore())
    client = make_client(middleware)
    for n in range(20):
        await client.post(f"/items/{n}", headers=HEADERS)
    resolver: RouteResolver = middleware._resolver
    assert len(resolver._cache) == 1


async def test_static_paths_skip_matching_but_unknown_paths_are_not_remembered() -> None:
    @idempotent()
    async def create(request: Request) -> Response:
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/static", create, methods=["POST"]),
            Route("/items/{n:int}", create, methods=["POST"]),
        ]
    )
    middleware = IdempotencyMiddleware(app, store=MemoryStore())
    client = make_client(middleware)
    for n in range(5):
        await client.post("/static", headers={"Idempotency-Key": f"s{n}"})
        await client.post(f"/items/{n}", headers={"Idempotency-Key": f"i{n}"})
        await client.post(f"/nowhere/{n}", headers=HEADERS)
    resolver: RouteResolver = middleware._resolver
    assert [key[2] for key in resolver._static] == ["/static"]
