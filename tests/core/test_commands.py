"""fingerprint="validated": the command is hashed, not the bytes; invalid bodies skip the store."""

from __future__ import annotations

import copy
import gzip
import json
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import APIRouter, Body, Depends, FastAPI, Request, Response, params
from fastapi.routing import APIRoute
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._command_fingerprint import CommandFingerprinter, fingerprinter_for_route
from starlette_idempotency._fingerprint import FINGERPRINT_SCHEME, MAX_JSON_DEPTH, drop_fields
from starlette_idempotency.stores import AcquireResult, IdempotencyRecord
from tests.support.guarded import make_client
from tests.support.json_values import json_values, same


class Line(BaseModel):
    sku: str
    quantity: int = 1


class Order(BaseModel):
    amount: float
    price: Decimal = Decimal("0")
    currency: str = "EUR"
    lines: list[Line] = []
    reference: str = Field(default_factory=lambda: uuid.uuid4().hex)
    client_timestamp: int | None = Field(default=None, alias="clientTimestamp")


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.calls["try_acquire"] += 1
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)


def build(**options: Any) -> tuple[FastAPI, Counter[str], CountingStore]:
    runs: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/orders/{shop}")
    @idempotent(fingerprint="validated", exclude_fields=["clientTimestamp"], **options)
    async def create(shop: int, order: Order) -> dict[str, int]:
        runs["orders"] += 1
        return {"n": runs["orders"]}

    store = CountingStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app, runs, store


async def send_twice(first: dict[str, Any], second: dict[str, Any], path: str = "/orders/1") -> int:
    app, runs, _ = build()
    client = make_client(app)
    headers = {"Idempotency-Key": "k"}
    assert (await client.post("/orders/1", json=first, headers=headers)).status_code == 200
    again = await client.post(path, json=second, headers=headers)
    return again.status_code if again.status_code != 200 else runs["orders"]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"amount": 10}, {"amount": 10.0}),
        ({"amount": 10}, {"amount": "10"}),
        ({"amount": 1}, {"amount": 1, "currency": "EUR"}),
        ({"amount": 1}, {"amount": 1, "lines": []}),
        (
            {"amount": 1, "lines": [{"sku": "a"}]},
            {"amount": 1, "lines": [{"sku": "a", "quantity": 1}]},
        ),
        ({"amount": 1, "price": "10"}, {"amount": 1, "price": "10.00"}),
        ({"amount": 1, "clientTimestamp": 1}, {"amount": 1, "clientTimestamp": 2}),
        ({"amount": 1, "reference": "r"}, {"reference": "r", "amount": 1}),
    ],
)
async def test_equal_commands_replay(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert await send_twice(first, second) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"amount": 10}, {"amount": 11}),
        ({"amount": 1}, {"amount": 1, "currency": "USD"}),
        ({"amount": 1, "reference": "r"}, {"amount": 1, "reference": "s"}),
        ({"amount": 1}, {"amount": 1, "reference": "s"}),  # a factory default sent only once
    ],
)
async def test_different_commands_are_a_mismatch(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    assert await send_twice(first, second) == 422


async def test_path_parameters_take_part() -> None:
    assert await send_twice({"amount": 1}, {"amount": 1}, path="/orders/2") == 422


async def test_invalid_body_gets_fastapis_422_without_a_store_call() -> None:
    app, runs, store = build()
    client = make_client(app)
    for body in ({"amount": "lots"}, {}):
        response = await client.post("/orders/1", json=body, headers={"Idempotency-Key": "k"})
        assert response.status_code == 422
        assert "detail" in response.json()  # FastAPI's own answer
    invalid_json = await client.post(
        "/orders/1",
        content=b"{nope",
        headers={"Idempotency-Key": "k", "content-type": "application/json"},
    )
    assert invalid_json.status_code == 422
    assert store.calls["try_acquire"] == 0
    assert runs["orders"] == 0


async def test_records_carry_the_fingerprint_version() -> None:
    app, _, store = build(fingerprint_version="7")
    await make_client(app).post("/orders/1", json={"amount": 1}, headers={"Idempotency-Key": "k"})
    (record,) = store.records().values()
    assert record.fingerprint_version == f"{FINGERPRINT_SCHEME}.validated.7"
    assert FINGERPRINT_SCHEME == "4"


async def test_what_the_app_parses_is_parsed_alike() -> None:
    """NaN and integers past 64 bits are JSON to Starlette; they must be commands here too."""
    app, runs, store = build()
    client = make_client(app)
    headers = {"Idempotency-Key": "k", "content-type": "application/json"}
    for _ in range(2):
        response = await client.post("/orders/1", content=b'{"amount": 1e400}', headers=headers)
        assert response.status_code == 200
    assert runs["orders"] == 1
    assert store.calls["try_acquire"] == 2


async def test_endpoint_never_runs_unprotected() -> None:
    from starlette_idempotency._endpoint import (
        GUARD_SCOPE_KEY,
        GUARDED_SCOPE,
        REQUEST_SCOPE_KEY,
        InvalidCommandMarks,
        UnprotectedEndpointError,
    )

    calls: list[int] = []

    @idempotent()
    async def endpoint(request: Request) -> None:
        calls.append(1)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/orders",
        "headers": [],
        "endpoint": endpoint,  # as a router dispatched it
        GUARD_SCOPE_KEY: endpoint,
        REQUEST_SCOPE_KEY: InvalidCommandMarks(),
    }
    token = GUARDED_SCOPE.set(scope)  # as the guard hands it on
    try:
        with pytest.raises(UnprotectedEndpointError):
            await endpoint(Request(scope))
    finally:
        GUARDED_SCOPE.reset(token)
    assert calls == []


JSON = "application/json"


def command(
    body: bytes,
    content_type: str = JSON,
    body_type: Any = Any,
    excluded: frozenset[str] = frozenset({"nonce"}),
) -> tuple[str, bytes | bytearray] | None:
    return CommandFingerprinter(body_type, excluded).canonical(body, content_type)


@given(json_values, json_values)
@example(2**64, 2**64 + 1)
@example(float("nan"), float("inf"))
@example(float("inf"), -float("inf"))
@example(float("nan"), None)
@example("\ud800", "\ud801")
def test_commands_are_exact(value: Any, other: Any) -> None:
    """Integers past 64 bits, NaN and the infinities, lone surrogates: each its own command."""
    first = command(json.dumps(value).encode(), excluded=frozenset())
    assert first is not None
    assert first[0] == "command"
    assert same(json.loads(first[1]), json.loads(json.dumps(value)))
    if not same(value, other):
        assert command(json.dumps(other).encode(), excluded=frozenset()) != first


class Amount(BaseModel):
    amount: int
    nonce: int = 0


def test_big_integers_in_a_model_are_exact() -> None:
    first = command(b'{"amount": 1180591620717411303424, "nonce": 1}', body_type=Amount)
    assert first == ("command", b'{"amount":1180591620717411303424}')
    assert command(b'{"amount": 1180591620717411304424}', body_type=Amount) != first


class OpenLine(BaseModel):
    model_config = ConfigDict(extra="allow")
    sku: str


class OpenOrder(BaseModel):
    model_config = ConfigDict(extra="allow")
    amount: int
    reference: str = Field(default_factory=lambda: uuid.uuid4().hex, alias="ref")
    lines: list[OpenLine] = []


extras = st.dictionaries(st.sampled_from(["to", "Nonce", "memo", "x"]), json_values, max_size=3)


@given(extras, extras, extras)
@example({"to": "alice"}, {"to": "mallory"}, {})
@example({"to": "alice"}, {"to": "alice", "Nonce": 1}, {"nonce": 2})
def test_the_extra_fields_a_model_allows_are_part_of_the_command(
    first: dict[str, Any], second: dict[str, Any], line_extra: dict[str, Any]
) -> None:
    """What the app reads in ``model_extra``, at any depth, tells commands apart, except
    for the excluded fields."""

    def body(extra: dict[str, Any]) -> bytes:
        line = {"sku": "a", **line_extra, **extra}
        return json.dumps({"amount": 1, "lines": [line], **extra}).encode()

    commands = [command(body(extra), body_type=OpenOrder) for extra in (first, second)]
    kept = [copy.deepcopy(extra) for extra in (first, second)]
    for extra in kept:
        drop_fields(extra, frozenset({"nonce"}))
    assert commands[0] is not None
    assert commands[0][0] == "command"
    assert (commands[0] == commands[1]) == same(kept[0], kept[1])


def test_an_extra_field_under_a_declared_name_takes_the_raw_form() -> None:
    """Sent as ``reference`` (only ``ref`` is read), it is no stand-in for the field."""
    as_field = command(b'{"amount": 1, "ref": "r"}', body_type=OpenOrder)
    as_extra = command(b'{"amount": 1, "reference": "r"}', body_type=OpenOrder)
    assert as_field == ("command", b'{"amount":1,"lines":[],"reference":"r"}')
    assert as_extra == ("json", b'{"amount":1,"reference":"r"}')


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_bodies_fastapi_does_not_read_as_json_take_the_raw_form() -> None:
    assert command(b'{"a": 1}', "text/plain") == ("bytes;text/plain", b'{"a": 1}')
    assert command(b"nonce=1&b=2&a=1", "application/x-www-form-urlencoded") == ("form", b"a=1&b=2")
    multipart = "multipart/form-data; boundary=x"
    assert command(b"--x--", multipart) == ("multipart", b"[]")
    assert command(b'{"b": 1, "a": 2}', "application/vnd.api+json") == ("command", b'{"a":2,"b":1}')


def test_a_body_without_a_content_type_is_json_only_where_the_route_says_so() -> None:
    lenient = CommandFingerprinter(Any, frozenset(), json_without_content_type=True)
    strict = CommandFingerprinter(Any, frozenset(), json_without_content_type=False)
    assert lenient.canonical(b'{"a": 1}', "") == ("command", b'{"a":1}')
    assert strict.canonical(b'{"a": 1}', "") == ("bytes;", b'{"a": 1}')
    assert strict.canonical(b"", "") == ("command", b"null")  # FastAPI reads no body at all


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 900, 2000, 100_000])
def test_deep_nesting_takes_the_raw_form(depth: int) -> None:
    assert command(nested(depth)) == ("bytes;application/json", nested(depth))
    assert command(nested(MAX_JSON_DEPTH)) == ("command", nested(MAX_JSON_DEPTH))


def test_what_json_or_the_model_rejects_is_no_command() -> None:
    assert command(b"{nope") is None
    assert command(b"1" * 5000) is None  # past int's 4300 digits: json.loads refuses it too
    assert command(b'{"amount": "lots"}', body_type=Amount) is None


@given(
    st.binary(max_size=40) | st.sampled_from([b"NaN", b'"\\ud800"', nested(300), b"1e400"]),
    st.sampled_from([JSON, "", "text/plain", "application/x-www-form-urlencoded"]),
    st.sampled_from([Any, Amount, str, list[int]]),
)
def test_any_body_gives_a_form_or_none(body: bytes, content_type: str, body_type: Any) -> None:
    result = command(body, content_type, body_type)
    assert result is None or isinstance(result[1], bytes)


def test_form_routes_take_the_raw_fingerprint() -> None:
    form_route = SimpleNamespace(body_field=SimpleNamespace(field_info=params.Form()))
    file_route = SimpleNamespace(body_field=SimpleNamespace(field_info=params.File()))
    assert fingerprinter_for_route(form_route, frozenset()) is None
    assert fingerprinter_for_route(file_route, frozenset()) is None


def test_the_routes_content_type_strictness_is_read() -> None:
    for strict in (True, False):
        app = FastAPI(strict_content_type=strict)

        @app.post("/m")
        async def m(body: Amount) -> None: ...

        (route,) = [r for r in app.routes if getattr(r, "path", "") == "/m"]
        fingerprinter = fingerprinter_for_route(route, frozenset())
        assert fingerprinter is not None
        kind = fingerprinter.canonical(b'{"amount": 1}', "")
        assert kind is not None
        assert kind[0] == ("bytes;" if strict else "command")


def included_orders(app: FastAPI, **inclusion: Any) -> Counter[str]:
    """``app`` with a router of one validated route included by ``inclusion``; its runs."""
    runs: Counter[str] = Counter()
    router = APIRouter()

    @router.post("/orders")
    @idempotent(fingerprint="validated")
    async def create(order: Line) -> dict[str, int]:
        runs["orders"] += 1
        return {"n": runs["orders"]}

    app.include_router(router, prefix="/v1", **inclusion)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    return runs


async def test_the_body_of_an_included_route_is_the_one_fastapi_validates() -> None:
    """A ``Body`` parameter of the inclusion's dependency embeds the route's body beside it:
    validated with the route's own model, every request was an invalid command, refused."""

    def verify(signature: str = Body()) -> None: ...

    app = FastAPI()
    runs = included_orders(app, dependencies=[Depends(verify)])
    client = make_client(app)
    headers = {"Idempotency-Key": "k"}
    sent = {"order": {"sku": "a"}, "signature": "s"}
    for body in (sent, {"signature": "s", "order": {"sku": "a", "quantity": 1}}):
        answer = await client.post("/v1/orders", json=body, headers=headers)
        assert answer.status_code == 200, answer.text
    assert answer.headers["x-idempotent-replay"] == "true"
    signed = await client.post("/v1/orders", json={**sent, "signature": "t"}, headers=headers)
    assert signed.status_code == 422  # the dependency's field is in the command
    assert runs == Counter({"orders": 1})


async def test_an_included_route_reads_the_content_type_strictness_of_its_inclusion() -> None:
    app = FastAPI(strict_content_type=False)  # the route leaves it to the router above it
    runs = included_orders(app)
    client = make_client(app)
    for body in (b'{"sku": "a"}', b'{"sku": "a", "quantity": 1}'):  # no content type: JSON
        answer = await client.post("/v1/orders", content=body, headers={"Idempotency-Key": "k"})
        assert answer.status_code == 200, answer.text
    assert answer.headers["x-idempotent-replay"] == "true"  # one command, not two bodies
    assert runs == Counter({"orders": 1})


class GzipRequest(Request):
    """FastAPI's documented custom request class: a gzip-encoded body is decompressed."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            body = await super().body()
            if "gzip" in self.headers.getlist("Content-Encoding"):
                body = gzip.decompress(body)
            self._body = body
        return self._body


class GzipRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        original = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await original(GzipRequest(request.scope, request.receive))

        return handler


async def test_optional_bodies_sent_empty_take_the_parameters_default() -> None:
    runs: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/none")
    @idempotent(fingerprint="validated")
    async def none_default(item: Line = None) -> dict[str, Any]:  # type: ignore[assignment]
        runs["none"] += 1
        return {"item": item}

    @app.post("/body-none")
    @idempotent(fingerprint="validated")
    async def body_none(item: Line = Body(None)) -> dict[str, Any]:  # noqa: B008
        runs["body-none"] += 1
        return {"item": item}

    @app.post("/instance")
    @idempotent(fingerprint="validated")
    async def instance_default(item: Line = Line(sku="x")) -> dict[str, Any]:  # noqa: B008
        runs["instance"] += 1
        return {"item": item}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    for path in ("/none", "/body-none", "/instance"):
        for _ in range(2):
            answer = await client.post(path, headers={"Idempotency-Key": path})
            assert answer.status_code == 200, answer.text
        assert answer.headers["x-idempotent-replay"] == "true"
        other = await client.post(path, json={"sku": "y"}, headers={"Idempotency-Key": path})
        assert other.status_code == 422  # a body now: another command than the default
    assert runs == Counter({"none": 1, "body-none": 1, "instance": 1})


async def test_gzip_encoded_bodies_on_a_decompressing_route_are_guarded() -> None:
    runs: Counter[str] = Counter()
    app = FastAPI()
    app.router.route_class = GzipRoute

    @app.post("/orders")
    @idempotent(fingerprint="validated")
    async def create(order: Order) -> dict[str, float]:
        runs["orders"] += 1
        return {"amount": order.amount}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    headers = {"Idempotency-Key": "k", "Content-Encoding": "gzip", "Content-Type": JSON}
    body = gzip.compress(b'{"amount": 3}')
    for _ in range(2):
        answer = await client.post("/orders", content=body, headers=headers)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"amount": 3}
    assert answer.headers["x-idempotent-replay"] == "true"
    other = await client.post("/orders", content=gzip.compress(b'{"amount": 4}'), headers=headers)
    assert other.status_code == 422
    assert runs["orders"] == 1
