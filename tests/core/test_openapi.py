"""The middleware in FastAPI's OpenAPI: which operations, what each shows, when it appears."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from fastapi import APIRouter, FastAPI, Header
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Host, Mount, Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._kept_response import ResponseEncryption
from starlette_idempotency._keys import key_pattern
from starlette_idempotency._openapi.fragments import key_schema
from starlette_idempotency._responses import Problem
from starlette_idempotency._routing import find_leaf, iter_routes

Schema = dict[str, Any]


class Payment(BaseModel):
    amount: int


def payments_app(**options: Any) -> FastAPI:
    """``POST /payments`` decorated, ``POST /notes`` not, ``GET /payments`` a read."""
    app = FastAPI()

    @app.post("/payments", status_code=201)
    @idempotent(ttl_hours=48)
    async def pay(body: Payment) -> Payment:
        return body

    @app.post("/notes")
    async def note(body: Payment) -> Payment:
        return body

    @app.get("/payments")
    async def payments() -> list[Payment]:
        return []

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **options)
    return app


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def served_schema(app: Any, url: str = "/openapi.json") -> Schema:
    """The schema the app serves (a request, so the middleware exists)."""
    async with client(app) as http:
        response = await http.get(url)
    assert response.status_code == 200, response.text
    schema: Schema = response.json()
    return schema


async def one_route_schema(
    path: str, middleware: dict[str, Any] | None = None, **options: Any
) -> Schema:
    """The schema served by an app whose one route, ``POST path``, is ``idempotent(**options)``
    (and the middleware's options ``middleware``)."""
    app = FastAPI()

    @app.post(path)
    @idempotent(**options)
    async def endpoint() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), **(middleware or {}))
    return await served_schema(app)


@asynccontextmanager
async def lifespan_of(app: Any) -> AsyncIterator[None]:
    """Run the app's lifespan through the ASGI protocol, as a server does."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))

    async def answer_to(message_type: str) -> str:
        await inbox.put({"type": message_type})
        reply = asyncio.ensure_future(outbox.get())
        await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            task.result()  # the app's exception, if it raised one
            raise AssertionError(f"the app ended its lifespan without answering {message_type}")
        return str(reply.result()["type"])

    assert await answer_to("lifespan.startup") == "lifespan.startup.complete"
    try:
        yield
    finally:
        assert await answer_to("lifespan.shutdown") == "lifespan.shutdown.complete"
        await task


def valid(schema: Schema) -> Schema:
    """``schema``, checked against the OpenAPI meta-schema."""
    schemathesis.openapi.from_dict(copy.deepcopy(schema)).validate()
    return schema


def key_parameters(operation: Schema) -> list[Schema]:
    return [p for p in operation.get("parameters", []) if p["name"].lower() == "idempotency-key"]


def error_schema(schema: Schema, response: Schema, media_type: str) -> Schema:
    """The middleware's body schema in ``response`` (the last ``anyOf`` branch, if merged)."""
    body: Schema = response["content"][media_type]["schema"]
    body = body.get("anyOf", [body])[-1]
    name = body["$ref"].rsplit("/", 1)[-1]
    found: Schema = schema["components"]["schemas"][name]
    return found


def accepts(body_schema: Schema, instance: object) -> bool:
    """Whether ``instance`` is valid against ``body_schema``."""
    return bool(jsonschema_rs.validator_for(body_schema).is_valid(instance))


async def test_a_decorated_route_shows_the_key_header_and_the_middleware_answers() -> None:
    schema = valid(await served_schema(payments_app()))
    operation = schema["paths"]["/payments"]["post"]
    (parameter,) = key_parameters(operation)
    assert parameter["in"] == "header"
    assert parameter["required"] is True
    assert parameter["schema"] == key_schema(255)
    assert parameter["schema"]["minLength"] == 1
    assert parameter["example"] == "8e03978e-40d5-43e8-bc93-6894a57f9324"
    assert "48 hours" in parameter["description"]
    responses = operation["responses"]
    assert list(responses) == ["201", "400", "409", "413", "422", "503"]
    for status in ("400", "409", "413", "503"):
        body = responses[status]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/IdempotencyError"}
    assert "Retry-After" in responses["409"]["headers"]
    assert "Retry-After" in responses["503"]["headers"]
    assert "1048576 bytes" in responses["413"]["description"]
    replay = responses["201"]["headers"]["X-Idempotent-Replay"]
    assert replay["schema"] == {"type": "string", "enum": ["true"]}


async def test_fastapi_validation_422_is_kept_beside_the_key_mismatch() -> None:
    schema = await served_schema(payments_app())
    response = schema["paths"]["/payments"]["post"]["responses"]["422"]
    assert response["description"].startswith("Validation Error\n\n")
    assert "Idempotency-Key is already used" in response["description"]
    assert response["content"]["application/json"]["schema"] == {
        "anyOf": [
            {"$ref": "#/components/schemas/HTTPValidationError"},
            {"$ref": "#/components/schemas/IdempotencyError"},
        ]
    }


async def test_undecorated_routes_and_reads_are_left_as_fastapi_made_them() -> None:
    app = payments_app()
    plain = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schema = await served_schema(app)
    assert schema["paths"]["/notes"] == plain["paths"]["/notes"]
    assert schema["paths"]["/payments"]["get"] == plain["paths"]["/payments"]["get"]
    assert schema["paths"]["/payments"]["post"] != plain["paths"]["/payments"]["post"]


async def test_protect_all_documents_every_guarded_method_but_no_read() -> None:
    schema = valid(await served_schema(payments_app(protect_all=True)))
    assert key_parameters(schema["paths"]["/notes"]["post"])
    notes_key = key_parameters(schema["paths"]["/notes"]["post"])[0]
    assert "24 hours" in notes_key["description"]  # the middleware's ttl, not the decorator's
    assert not key_parameters(schema["paths"]["/payments"]["get"])


# FastAPI names both operations of a two-method route alike, and says so
@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")
async def test_only_the_guarded_methods_of_a_route_are_documented() -> None:
    app = FastAPI()

    # A safe method: an unguarded PUT of a decorated handler refuses every request (#30).
    @app.api_route("/items", methods=["POST", "GET"])
    @idempotent()
    async def upsert() -> dict[str, int]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), methods=["POST"])
    schema = await served_schema(app)
    assert key_parameters(schema["paths"]["/items"]["post"])
    assert not key_parameters(schema["paths"]["/items"]["get"])


async def test_header_name_key_length_and_problem_format() -> None:
    app = payments_app(
        header_name="X-Request-Key",
        max_key_length=64,
        max_body_bytes=1000,
        error_format="problem",
        problem_type="https://errors.example/idempotency",
    )
    schema = valid(await served_schema(app))
    operation = schema["paths"]["/payments"]["post"]
    assert not key_parameters(operation)
    (parameter,) = [p for p in operation["parameters"] if p["name"] == "X-Request-Key"]
    assert parameter["schema"]["pattern"] == key_pattern(64)
    assert "at most 64 characters" in parameter["description"]
    responses = operation["responses"]
    assert "X-Request-Key is missing" in responses["400"]["description"]
    assert "1000 bytes" in responses["413"]["description"]
    assert set(responses["409"]["content"]) == {"application/problem+json"}
    # FastAPI's own 422 stays JSON; the mismatch is problem details beside it
    assert responses["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/HTTPValidationError"
    }
    problem = error_schema(schema, responses["409"], "application/problem+json")
    assert problem["required"] == ["type", "title", "status", "detail"]
    types = problem["properties"]["type"]["enum"]
    assert len(types) == len(Problem)
    assert "https://errors.example/idempotency/key-in-use" in types
    assert all(uri.startswith("https://errors.example/idempotency/") for uri in types)


@pytest.mark.parametrize("error_format", ["json", "problem", "stripe"])
async def test_the_body_schema_accepts_what_the_middleware_sends(error_format: str) -> None:
    app = payments_app(error_format=error_format)
    schema = await served_schema(app)
    media_type = "application/problem+json" if error_format == "problem" else "application/json"
    async with client(app) as http:
        missing = await http.post("/payments", json={"amount": 1})
    assert missing.status_code == 400
    assert missing.headers["content-type"] == media_type
    response = schema["paths"]["/payments"]["post"]["responses"]["400"]
    body_schema = error_schema(schema, response, media_type)
    assert accepts(body_schema, missing.json())
    body, properties = missing.json(), body_schema["properties"]
    if error_format == "stripe":
        body, properties = body["error"], properties["error"]["properties"]
    assert properties["code"]["enum"] == [problem.code for problem in Problem]  # to switch on
    body["code"] = "made_up"
    assert not accepts(body_schema, body if error_format != "stripe" else {"error": body})
    # ``code`` is optional: bodies from before it was added are valid too
    if error_format == "json":
        assert accepts(body_schema, {"error": "Idempotency-Key header is required"})
        assert not accepts(body_schema, {"error": {"message": "nested"}})
    elif error_format == "stripe":
        assert accepts(body_schema, {"error": {"type": "invalid_request_error", "message": "m"}})
        assert not accepts(body_schema, {"error": "flat"})
    else:
        old = {"type": "about:blank", "title": "t", "status": 400, "detail": "d"}
        assert accepts(body_schema, old)
        assert not accepts(body_schema, {"title": "t"})


async def test_an_error_format_callable_documents_an_application_json_object() -> None:
    app = payments_app(error_format=lambda problem: {"oops": problem.code})
    schema = valid(await served_schema(app))
    response = schema["paths"]["/payments"]["post"]["responses"]["409"]
    body_schema = error_schema(schema, response, "application/json")
    assert body_schema["type"] == "object"
    assert "properties" not in body_schema


async def test_an_optional_key_is_not_required_and_never_missing() -> None:
    app = FastAPI()

    @app.patch("/members/{member_id}")
    @idempotent(required=False)
    async def update(member_id: int) -> dict[str, int]:
        return {"id": member_id}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    operation = valid(await served_schema(app))["paths"]["/members/{member_id}"]["patch"]
    (parameter,) = key_parameters(operation)
    assert parameter["required"] is False
    assert "Optional" in parameter["description"]
    assert "is missing" not in operation["responses"]["400"]["description"]
    assert "is invalid" in operation["responses"]["400"]["description"]


async def test_replay_reject_documents_already_processed_with_its_location() -> None:
    schema = valid(await one_route_schema("/orders", replay="reject"))
    operation = schema["paths"]["/orders"]["post"]
    conflict = operation["responses"]["409"]
    assert "Idempotency-Key was already processed" in conflict["description"]
    assert "A request is outstanding" in conflict["description"]
    assert set(conflict["headers"]) == {"Retry-After", "Location"}
    assert "refused (409)" in key_parameters(operation)[0]["description"]
    # such a route never replays: its success answers carry no replay headers
    assert "X-Idempotent-Replay" not in operation["responses"]["200"].get("headers", {})


async def test_the_unreadable_503_is_documented_only_with_encryption() -> None:
    plain = await one_route_schema("/open", on_store_error="fail_open")
    assert "503" not in plain["paths"]["/open"]["post"]["responses"]
    encryption = ResponseEncryption({"k": ResponseEncryption.generate_key()})
    sealed = await one_route_schema("/open", {"encryption": encryption}, on_store_error="fail_open")
    unreadable = sealed["paths"]["/open"]["post"]["responses"]["503"]
    assert "cannot be read" in unreadable["description"]
    assert "Retry-After" not in unreadable.get("headers", {})  # that one sends none


async def test_fail_open_routes_have_no_503() -> None:
    app = FastAPI()

    @app.post("/open")
    @idempotent(on_store_error="fail_open")
    async def fail_open() -> dict[str, str]:
        return {}

    @app.post("/closed")
    @idempotent()
    async def fail_closed() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    paths = (await served_schema(app))["paths"]
    assert "503" not in paths["/open"]["post"]["responses"]
    assert "503" in paths["/closed"]["post"]["responses"]


async def test_hold_on_recovery_documents_the_202() -> None:
    schema = valid(await one_route_schema("/charges", on_recovery="hold"))
    accepted = schema["paths"]["/charges"]["post"]["responses"]["202"]
    assert accepted["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/IdempotencyRecoveryPending"
    }
    assert "X-Idempotent-Replay" not in accepted.get("headers", {})


async def test_every_problem_the_middleware_can_send_is_documented() -> None:
    encryption = ResponseEncryption({"k": ResponseEncryption.generate_key()})
    schema = await one_route_schema("/all", {"encryption": encryption}, replay="reject")
    responses = schema["paths"]["/all"]["post"]["responses"]
    for problem in Problem:
        described = responses[str(problem.status)]["description"]
        assert problem.title.format(header="Idempotency-Key") in described, problem


async def test_included_routers_with_prefixes_and_path_convertors() -> None:
    items = APIRouter(prefix="/items")

    @items.post("/{item_id:int}")
    @idempotent()
    async def create(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    @items.post("/{item_id:int}/notes")
    async def notes(item_id: int) -> dict[str, int]:
        return {"id": item_id}

    v1 = APIRouter(prefix="/v1")
    v1.include_router(items)
    app = FastAPI()
    app.include_router(v1, prefix="/api")
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    paths = valid(await served_schema(app))["paths"]
    assert key_parameters(paths["/api/v1/items/{item_id}"]["post"])
    assert not key_parameters(paths["/api/v1/items/{item_id}/notes"]["post"])


async def test_the_first_route_for_a_path_and_method_decides() -> None:
    app = FastAPI()

    async def first() -> dict[str, str]:
        return {"ran": "first"}

    @idempotent()
    async def second() -> dict[str, str]:
        return {"ran": "second"}

    app.add_api_route("/twice", first, methods=["POST"])
    app.add_api_route("/twice", second, methods=["POST"])
    app.add_api_route("/guarded-first", second, methods=["POST"])
    app.add_api_route("/guarded-first", first, methods=["POST"])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    schema = await served_schema(app)
    assert not key_parameters(schema["paths"]["/twice"]["post"])
    assert key_parameters(schema["paths"]["/guarded-first"]["post"])
    async with client(app) as http:  # as the middleware decides: the first route is not guarded
        assert (await http.post("/twice")).json() == {"ran": "first"}


async def test_a_mounted_fastapi_app_is_documented_by_its_own_middleware() -> None:
    sub = payments_app(header_name="X-Sub-Key")
    parent = FastAPI()

    @parent.post("/orders")
    @idempotent()
    async def order() -> dict[str, str]:
        return {}

    parent.mount("/sub", sub)
    parent.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    parent_schema = await served_schema(parent)
    assert key_parameters(parent_schema["paths"]["/orders"]["post"])
    assert set(parent_schema["paths"]) == {"/orders"}
    sub_schema = valid(await served_schema(parent, "/sub/openapi.json"))
    operation = sub_schema["paths"]["/payments"]["post"]
    assert [p["name"] for p in operation["parameters"]] == ["X-Sub-Key"]


async def test_a_fastapi_app_whose_routes_another_middleware_guards_is_left_alone() -> None:
    @idempotent()
    async def mounted(request: Request) -> JSONResponse:
        return JSONResponse({})

    mount = Mount(
        "/m",
        routes=[Route("/orders", mounted, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    app = FastAPI(routes=[mount])

    @app.post("/payments")
    @idempotent()
    async def pay() -> dict[str, str]:
        return {}

    async with client(app) as http:
        assert (await http.post("/m/orders")).status_code == 400  # that middleware runs
    assert "openapi" not in vars(app)
    assert not key_parameters(app.openapi()["paths"]["/payments"]["post"])


async def test_a_users_openapi_override_is_composed_not_replaced() -> None:
    app = payments_app()
    calls = []

    def custom_openapi() -> Schema:
        calls.append(1)
        if app.openapi_schema:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        schema["info"]["x-logo"] = {"url": "https://example.com/logo.png"}
        app.openapi_schema = schema
        return schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    first = await served_schema(app)
    second = await served_schema(app)
    assert first == second
    assert first["info"]["x-logo"] == {"url": "https://example.com/logo.png"}
    assert len(key_parameters(first["paths"]["/payments"]["post"])) == 1
    assert len(calls) == 2
    assert app.openapi() is app.openapi()


async def test_a_route_added_after_startup_is_documented() -> None:
    app = payments_app()
    assert key_parameters((await served_schema(app))["paths"]["/payments"]["post"])

    @app.post("/late")
    @idempotent()
    async def late() -> dict[str, str]:
        return {}

    app.openapi_schema = None  # FastAPI 0.115 keeps its cached schema; newer ones rebuild it
    assert key_parameters(app.openapi()["paths"]["/late"]["post"])


async def test_a_key_header_the_route_declares_is_not_added_twice() -> None:
    app = FastAPI()

    @app.post("/declared")
    @idempotent()
    async def declared(idempotency_key: str = Header()) -> dict[str, str]:
        return {"key": idempotency_key}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    operation = (await served_schema(app))["paths"]["/declared"]["post"]
    assert [p["name"] for p in operation["parameters"]] == ["idempotency-key"]
    assert "409" in operation["responses"]


async def test_a_starlette_app_is_untouched() -> None:
    @idempotent()
    async def pay(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=201)

    app = Starlette(
        routes=[Route("/payments", pay, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    before = dict(vars(app))
    async with lifespan_of(app), client(app) as http:
        answer = await http.post("/payments", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 201
    assert set(vars(app)) == set(before)
    assert {name for name in vars(app) if vars(app)[name] is not before[name]} == {
        "middleware_stack"
    }


def test_iter_routes_walks_as_find_leaf_matches() -> None:
    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({})

    items = APIRouter(prefix="/items")
    items.add_api_route("/{item_id:int}", endpoint, methods=["POST"])
    items.add_route("/{item_id:int}/raw", endpoint, methods=["PUT"])
    v1 = APIRouter(prefix="/v1")
    v1.include_router(items)
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.include_router(v1, prefix="/api")
    app.mount("/mounted", Starlette(routes=[Route("/deep/{name}", endpoint, methods=["POST"])]))
    hosted = Starlette(routes=[Route("/hosted", endpoint, methods=["PATCH"])])
    app.router.routes.append(Host("api.example", app=hosted))
    entries = list(iter_routes(app.routes))
    assert [(entry.template, sorted(entry.methods)) for entry in entries] == [
        ("/api/v1/items/{item_id:int}", ["POST"]),
        ("/api/v1/{item_id:int}/raw", ["PUT"]),  # add_route takes no router prefix
        ("/mounted/deep/{name}", ["POST"]),
        ("/hosted", ["PATCH"]),
    ]
    paths = ["/api/v1/items/7", "/api/v1/7/raw", "/mounted/deep/n", "/hosted"]
    for entry, path in zip(entries, paths, strict=True):
        scope = {
            "type": "http",
            "method": next(iter(entry.methods)),
            "path": path,
            "root_path": "",
            "headers": [(b"host", b"api.example")],
            "query_string": b"",
        }
        leaf = find_leaf(app.routes, scope)
        assert leaf is not None, path
        assert (leaf.route, leaf.template, leaf.endpoint) == (
            entry.route,
            entry.template,
            entry.handler,
        )


async def test_a_middleware_stack_built_again_documents_once() -> None:
    app = payments_app()
    await served_schema(app)
    app.middleware_stack = app.build_middleware_stack()  # a new IdempotencyMiddleware
    schema = await served_schema(app)
    operation = schema["paths"]["/payments"]["post"]
    assert len(key_parameters(operation)) == 1
    assert operation["responses"]["409"]["description"].count("idempotency middleware") == 1
    assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
        "anyOf": [
            {"$ref": "#/components/schemas/HTTPValidationError"},
            {"$ref": "#/components/schemas/IdempotencyError"},
        ]
    }
