"""``key_from``, ``key_format`` and ``release_statuses``: each option checked when it is given,
and what each does to a request (in process, on MemoryStore; the same through uvicorn and
Redis is tests/e2e/test_webhooks.py)."""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    KeySource,
    MemoryStore,
    idempotent,
    mark_retryable,
)
from starlette_idempotency._keys import (
    _NOT_FOUND,
    InvalidKey,
    KeyFormat,
    check_key,
    field_at,
    parse_key,
)
from tests.core.test_openapi import served_schema, valid
from tests.support.guarded import make_client

# -- every option is checked where it is given ------------------------------------------------


async def async_predicate(value: object) -> bool:
    return False


class AsyncPredicate:
    async def __call__(self, value: object) -> bool:
        return False


@functools.wraps(async_predicate)
def wrapped_async_predicate(value: object) -> Any:
    return async_predicate(value)


def answering_a_coroutine(value: Any) -> Any:
    """An async function behind a plain one (a lambda, a cache): nothing to unwrap."""
    return async_predicate(value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"key_from": "webhook-id"}, r"KeySource.header\('webhook-id'\)"),
        ({"key_from": 42}, "key_from must be KeySource.header"),
        ({"key_from": lambda request: "k"}, "must take two arguments"),
        ({"key_format": "("}, "not a valid regular expression"),
        ({"key_format": "UUID"}, "key_format='uuid'"),
        ({"key_format": ""}, "must not be an empty regular expression"),
        ({"key_format": 36}, "key_format must be 'uuid'"),
        ({"release_statuses": "500"}, "collection of HTTP statuses"),
        ({"release_statuses": 500}, "collection of HTTP statuses"),
        ({"release_statuses": [500, 99]}, r"from 100 to 599\), not 99"),
        ({"release_statuses": [True]}, "not True"),
        ({"release_statuses": ["500"]}, "not '500'"),
        ({"key_format": async_predicate}, r"key_format must be a plain function str -> bool"),
        ({"key_format": AsyncPredicate()}, r"\(def, not async def\)"),
        ({"release_statuses": async_predicate}, "release_statuses must be a plain function"),
        ({"release_statuses": AsyncPredicate()}, r"\(def, not async def\), not <tests"),
        ({"release_statuses": wrapped_async_predicate}, "must be a plain function"),
        ({"key_format": wrapped_async_predicate}, "must be a plain function"),
    ],
)
def test_a_wrong_value_is_refused_by_the_decorator_and_the_middleware(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        idempotent(**options)
    with pytest.raises(ConfigurationError, match=message):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KeySource.header("webhook id"), "HTTP header name"),
        (lambda: KeySource.header(""), "HTTP header name"),
        (lambda: KeySource.header("Authorization"), "credentials"),
        (lambda: KeySource.header("cookie"), "credentials"),
        (lambda: KeySource.json_field(""), "dotted path"),
        (lambda: KeySource.json_field("data..id"), "dotted path"),
        (lambda: KeySource.json_field("data.id."), "dotted path"),
    ],
)
def test_a_wrong_source_is_refused_where_it_is_made(make: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_sources_show_how_they_were_made_and_equal_their_twins() -> None:
    assert repr(KeySource.header("webhook-id")) == "KeySource.header('webhook-id')"
    assert repr(KeySource.json_field("data.id")) == "KeySource.json_field('data.id')"
    assert KeySource.header("webhook-id") == KeySource.header("webhook-id")
    assert KeySource.header("id") != KeySource.json_field("id")
    assert len({KeySource.of(sync_source), KeySource.of(sync_source)}) == 1


# -- the sources -------------------------------------------------------------------------------


def app_with(
    runs: list[str], status: int = 201, **options: Any
) -> tuple[Starlette, httpx.AsyncClient]:
    """One guarded ``POST /hook`` answering ``status`` (or raising for ``{"raise": true}``)."""

    @idempotent(**options)
    async def hook(request: Request) -> Response:
        body = await request.json() if await request.body() else {}
        runs.append(str(body))
        if body.get("retryable"):
            mark_retryable(request)
        if body.get("raise"):
            raise RuntimeError("the handler failed")
        return JSONResponse({"run": len(runs)}, status_code=status)

    middleware = Middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
    app = Starlette(routes=[Route("/hook", hook, methods=["POST"])], middleware=[middleware])
    return app, make_client(app, raise_app_exceptions=False)


async def test_an_option_given_as_none_takes_the_middlewares_value() -> None:
    """``None`` means "as the middleware says" (the options reference), not the default."""
    runs: list[str] = []

    @idempotent(release_statuses=None, key_from=None)
    async def hook(request: Request) -> Response:
        runs.append("run")
        return JSONResponse({}, status_code=503)

    middleware = Middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        key_scope=lambda r: "t",
        release_statuses=(),
        key_from=KeySource.json_field("id"),
    )
    app = Starlette(routes=[Route("/hook", hook, methods=["POST"])], middleware=[middleware])
    client = make_client(app)
    first = await client.post("/hook", json={"id": "e1"})
    retry = await client.post("/hook", json={"id": "e1"})
    assert (first.status_code, retry.headers["x-idempotent-replay"]) == (503, "true")
    assert runs == ["run"]


def sync_source(request: HTTPConnection, body: bytes) -> str | None:
    return request.headers.get("x-delivery")


async def async_source(request: HTTPConnection, body: bytes) -> str | None:
    return request.headers.get("x-delivery")


@pytest.mark.parametrize("source", [sync_source, async_source], ids=["sync", "async"])
async def test_a_function_source_may_be_sync_or_async(source: Any) -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=source)
    first = await client.post("/hook", json={"a": 1}, headers={"x-delivery": "d1"})
    retry = await client.post("/hook", json={"a": 1}, headers={"x-delivery": "d1"})
    assert (first.status_code, retry.headers["x-idempotent-replay"]) == (201, "true")
    missing = await client.post("/hook", json={"a": 1})
    assert missing.status_code == 400
    assert missing.json()["error"] == (
        f"An idempotency key is required: key_from {source.__qualname__} found none in the request"
    )
    assert len(runs) == 1


async def test_a_function_source_that_returns_no_string_fails_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=lambda request, body: b"bytes")
    response = await client.post("/hook", json={})
    assert response.status_code == 500
    assert runs == []


async def test_a_function_source_raising_an_http_exception_is_the_apps_answer() -> None:
    from starlette.exceptions import HTTPException

    def refuse(request: HTTPConnection, body: bytes) -> str:
        raise HTTPException(401, "bad signature")

    runs: list[str] = []
    _, client = app_with(runs, key_from=refuse)
    response = await client.post("/hook", json={})
    assert (response.status_code, response.text) == (401, "bad signature")
    assert runs == []


async def test_an_optional_body_source_runs_a_request_without_a_key_unprotected() -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.json_field("id"), required=False)
    for _ in range(2):
        assert (await client.post("/hook", json={"other": 1})).status_code == 201
    assert runs == ["{'other': 1}"] * 2  # the body reached the app whole, each time


@pytest.mark.parametrize("number", ["18446744073709551616", "-9223372036854775809", str(10**40)])
async def test_an_integer_field_beyond_64_bits_is_a_key(number: str) -> None:
    """orjson reads such an integer as a float: the webhook was refused 400, "not float"."""
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.json_field("data.id"))
    body = f'{{"data": {{"id": {number}}}}}'
    headers = {"content-type": "application/json"}
    first = await client.post("/hook", content=body, headers=headers)
    retry = await client.post("/hook", content=body, headers=headers)
    assert first.status_code == 201, first.text
    assert retry.headers["x-idempotent-replay"] == "true"
    other = await client.post("/hook", content=body.replace(number, number + "1"), headers=headers)
    assert other.status_code == 201
    assert "x-idempotent-replay" not in other.headers
    assert len(runs) == 2


async def test_a_float_field_is_still_refused() -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.json_field("id"))
    response = await client.post("/hook", json={"id": 1.5})
    assert response.status_code == 400
    assert "must be a string or an integer, not float" in response.json()["error"]


@pytest.mark.parametrize(
    ("first", "second"),
    [('"alice+bob"', '"alice bob"'), ('"%41CME"', '"ACME"')],
)
async def test_a_json_body_labelled_a_form_is_fingerprinted_as_the_json_read(
    first: str, second: str
) -> None:
    """The key is read from the body as JSON, and so is the body by the app, whatever its
    label: as a form, these pairs of JSON values were one request, the second a replay."""
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.json_field("id"))
    form = {"content-type": "application/x-www-form-urlencoded"}
    sent = await client.post("/hook", content=f'{{"id": "t1", "to": {first}}}', headers=form)
    retry = await client.post("/hook", content=f'{{"to":{first},"id":"t1"}}', headers=form)
    other = await client.post("/hook", content=f'{{"id": "t1", "to": {second}}}', headers=form)
    assert (sent.status_code, retry.headers["x-idempotent-replay"]) == (201, "true")
    assert other.status_code == 422
    assert len(runs) == 1


async def test_a_header_source_is_parsed_as_the_key_header_is() -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.header("webhook-id"))
    quoted = await client.post("/hook", json={}, headers={"webhook-id": '"a b,c"'})
    assert quoted.status_code == 201
    twice = await client.post("/hook", json={}, headers=[("webhook-id", "a"), ("webhook-id", "b")])
    assert twice.status_code == 400
    assert twice.json()["error"].startswith("webhook-id must be sent only once")


class Event(BaseModel):
    id: str
    amount: int


async def test_a_fastapi_endpoint_reads_the_body_its_key_came_from() -> None:
    app = FastAPI()
    handled: list[Event] = []

    @app.post("/events")
    @idempotent(key_from=KeySource.json_field("id"))
    async def receive(event: Event) -> dict[str, int]:
        handled.append(event)
        return {"handled": len(handled)}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
    client = make_client(app)
    first = await client.post("/events", json={"id": "evt_1", "amount": 5})
    retry = await client.post("/events", json={"amount": 5, "id": "evt_1"})
    assert first.json() == retry.json() == {"handled": 1}
    assert retry.headers["x-idempotent-replay"] == "true"
    assert handled == [Event(id="evt_1", amount=5)]


async def test_error_titles_name_the_source() -> None:
    @idempotent(key_from=KeySource.json_field("data.id"))
    async def hook(request: Request) -> Response:
        return JSONResponse({})

    app = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    client = make_client(
        IdempotencyMiddleware(app, store=MemoryStore(), error_format="problem", key_scope=str)
    )
    missing = await client.post("/hook", json={"data": {}})
    assert missing.json()["title"] == "JSON field data.id is missing"
    assert missing.json()["detail"] == "JSON field data.id (the idempotency key) is required"


# -- key_format --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key_format", "accepted", "refused", "message"),
    [
        (
            "uuid",
            ["8e03978e-40d5-43e8-bc93-6894a57f9324", '"00000000-0000-0000-0000-000000000000"'],
            ["abc", "8E03978E-40D5-43E8-BC93-6894A57F9324", "8e03978e40d543e8bc936894a57f9324"],
            "Idempotency-Key must be a UUID in its canonical text form",
        ),
        (
            "ord_[0-9]{4}",
            ["ord_1234"],
            ["ord_12345", "xord_1234", "ord_"],
            "Idempotency-Key must be a key matching ord_",
        ),
        (
            re.compile("ord_[0-9]{4}"),
            ["ord_1234"],
            ["ord_12345", "ORD_1234"],
            "Idempotency-Key must be a key matching ord_",
        ),
        (
            lambda key: len(key) >= 8,
            ["12345678"],
            ["1234567"],
            "Idempotency-Key must be a key <lambda> accepts",
        ),
    ],
    ids=["uuid", "regex", "compiled", "predicate"],
)
async def test_key_format_refuses_a_key_before_anything_runs(
    key_format: Any, accepted: list[str], refused: list[str], message: str
) -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_format=key_format)
    for key in refused:
        response = await client.post("/hook", json={}, headers={"Idempotency-Key": key})
        assert response.status_code == 400, key
        assert response.json()["code"] == "idempotency_key_invalid"
        assert response.json()["error"].startswith(message)
    assert runs == []
    for key in accepted:
        response = await client.post("/hook", json={}, headers={"Idempotency-Key": key})
        assert response.status_code == 201, key
    assert len(runs) == len(accepted)


async def test_key_format_applies_to_a_key_from_the_body() -> None:
    runs: list[str] = []
    _, client = app_with(runs, key_from=KeySource.json_field("id"), key_format="evt_[a-z0-9]+")
    refused = await client.post("/hook", json={"id": "ch_1"})
    assert refused.status_code == 400
    assert refused.json()["error"] == "JSON field id must be a key matching evt_[a-z0-9]+"
    assert (await client.post("/hook", json={"id": "evt_1"})).status_code == 201


@given(st.uuids(), st.text(alphabet="0123456789abcdefABCDEF-{}urn:", max_size=45))
@example(uuid.UUID(int=0), "")
@example(uuid.UUID(int=2**128 - 1), "")
def test_uuid_format_accepts_exactly_the_canonical_text_of_a_uuid(
    value: uuid.UUID, text: str
) -> None:
    uuid_format = KeyFormat.of("uuid")
    assert uuid_format.checked(str(value), "k") == str(value)
    for candidate in (text, str(value).upper(), value.hex, "{" + str(value) + "}"):
        try:
            canonical = str(uuid.UUID(candidate)) == candidate
        except ValueError:
            canonical = False
        assert (uuid_format.checked(candidate, "k") == candidate) is canonical


# -- release_statuses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "release_statuses", "runs_again"),
    [
        (503, None, True),
        (409, None, False),
        (503, (), False),
        (409, {409}, True),
        (503, {409}, False),
        (429, lambda status: status != 429, False),
        (201, lambda status: status == 201, True),
    ],
)
async def test_release_statuses_decides_which_outcomes_free_the_key(
    status: int, release_statuses: Any, runs_again: bool
) -> None:
    runs: list[str] = []
    _, client = app_with(runs, status=status, release_statuses=release_statuses)
    first = await client.post("/hook", json={}, headers={"Idempotency-Key": "k"})
    retry = await client.post("/hook", json={}, headers={"Idempotency-Key": "k"})
    assert first.status_code == retry.status_code == status
    assert len(runs) == (2 if runs_again else 1)
    assert ("x-idempotent-replay" in retry.headers) is not runs_again
    if not runs_again:
        assert retry.content == first.content


async def test_a_release_predicate_that_raises_leaves_the_default_to_decide(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(status: int) -> bool:
        raise ZeroDivisionError

    runs: list[str] = []
    _, client = app_with(runs, status=503, release_statuses=broken)
    with caplog.at_level(logging.ERROR):
        for _ in range(2):
            await client.post("/hook", json={}, headers={"Idempotency-Key": "k"})
    assert len(runs) == 2  # a 503 frees the key, as by default
    assert "release_statuses" in caplog.text


@pytest.mark.parametrize(("release_statuses", "stored"), [(None, False), ((), True), ({503}, True)])
async def test_an_exception_is_the_500_release_statuses_decides_on(
    release_statuses: Any, stored: bool
) -> None:
    runs: list[str] = []
    _, client = app_with(runs, release_statuses=release_statuses)
    for _ in range(2):
        response = await client.post(
            "/hook", json={"raise": True}, headers={"Idempotency-Key": "k"}
        )
        assert response.status_code == 500
    assert len(runs) == (1 if stored else 2)
    if stored:
        assert response.headers["x-idempotent-replay"] == "true"
        assert response.headers["x-idempotent-body-omitted"] == "true"


async def test_mark_retryable_frees_the_key_whatever_release_statuses_keeps() -> None:
    runs: list[str] = []
    _, client = app_with(runs, status=500, release_statuses=())
    for _ in range(2):
        await client.post("/hook", json={"retryable": True}, headers={"Idempotency-Key": "k"})
    assert len(runs) == 2


def test_the_middleware_default_is_overridden_by_the_route() -> None:
    from starlette_idempotency._options import IdempotencyPolicy

    defaults = IdempotencyPolicy(release_statuses=())
    assert not defaults.releases(500)
    assert defaults.merged({"release_statuses": {500}}).releases(500)
    assert IdempotencyPolicy().releases(500)
    assert IdempotencyPolicy().releases(408)
    assert not IdempotencyPolicy().releases(409)


# -- what a key from any source must be --------------------------------------------------------

_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))
_SEGMENT = st.text(alphabet="abcxyz_0123456789", min_size=1, max_size=4)


@given(st.lists(_SEGMENT, min_size=1, max_size=5), _JSON_LEAF, st.data())
def test_a_json_field_is_found_at_its_path_and_nowhere_else(
    path: list[str], leaf: object, data: st.DataObject
) -> None:
    value: Any = leaf
    for segment in reversed(path):
        if segment.isdigit() and int(segment) < 4 and data.draw(st.booleans(), label="array"):
            value = [data.draw(_JSON_LEAF) for _ in range(int(segment))] + [value]
        else:  # the member among others
            value = {**data.draw(st.dictionaries(_SEGMENT, _JSON_LEAF, max_size=2)), segment: value}
    assert field_at(value, tuple(path)) == leaf
    assert field_at(value, (*path, "deeper")) is _NOT_FOUND
    assert field_at(value, ("missing-" + path[0], *path[1:])) is _NOT_FOUND


@given(st.text(max_size=20))
def test_a_key_from_the_body_is_valid_exactly_when_the_header_could_carry_it(key: str) -> None:
    from_body = check_key(key, name="k", max_length=10)
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    try:
        raw = f'"{escaped}"'.encode("ascii")
    except UnicodeEncodeError:
        assert isinstance(from_body, InvalidKey)
        return
    from_header = parse_key(raw, header_name="k", max_length=10)
    assert (from_body == key) is (from_header == key)


# -- OpenAPI -----------------------------------------------------------------------------------


async def test_openapi_documents_the_header_source_and_the_format() -> None:
    app = FastAPI()

    @app.post("/standard")
    @idempotent(key_from=KeySource.header("webhook-id"), key_format="uuid")
    async def standard() -> dict[str, str]:
        return {}

    @app.post("/stripe")
    @idempotent(key_from=KeySource.json_field("id"), key_format="evt_[A-Za-z0-9]+")
    async def stripe() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    schema = valid(await served_schema(app))
    standard_op = schema["paths"]["/standard"]["post"]
    (parameter,) = standard_op["parameters"]
    assert parameter["name"] == "webhook-id"
    assert parameter["schema"]["format"] == "uuid"
    pattern = re.compile(parameter["schema"]["pattern"])
    assert pattern.search(str(uuid.uuid4()))
    assert not pattern.search("abc")
    assert "a UUID" in parameter["description"]
    stripe_op = schema["paths"]["/stripe"]["post"]
    assert "parameters" not in stripe_op or not stripe_op["parameters"]
    invalid = stripe_op["responses"]["400"]["description"]
    assert "JSON field id is invalid" in invalid
    assert "Or it is not a key matching evt_[A-Za-z0-9]+." in invalid
    assert "Or the body is not JSON (this route reads its key from JSON field id)." in invalid
    error = schema["components"]["schemas"]["IdempotencyError"]
    assert error["properties"]["first_request"]["required"] == ["status"]


def test_a_pattern_with_flags_is_not_shown_in_openapi() -> None:
    assert KeyFormat.of("ord_[0-9]+").pattern == "^(?:ord_[0-9]+)$"
    assert KeyFormat.of("(?i)ord_[0-9]+").pattern is None
    assert KeyFormat.of(re.compile("ord_[0-9]+", re.IGNORECASE)).pattern is None
    assert KeyFormat.of("(?i)ord_[0-9]+").checked("ORD_1", "k") == "ORD_1"


async def test_openapi_lists_a_body_that_is_no_json_for_a_json_field_only() -> None:
    app = FastAPI()

    @app.post("/github")
    @idempotent(key_from=sync_source)
    async def github() -> dict[str, str]:
        return {}

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    schema = valid(await served_schema(app))
    operation = schema["paths"]["/github"]["post"]
    assert not operation.get("parameters")
    invalid = operation["responses"]["400"]["description"]
    assert "Idempotency key is missing" in invalid
    assert "not JSON" not in invalid


async def test_a_predicate_answering_an_awaitable_is_never_taken_as_true(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An async function behind a plain one passes the check where it is given; its coroutine,
    always true, freed every 201 and let every key pass. Refused where it is called: the key
    is refused, and the default decides what frees the key."""
    runs = 0

    def counted(**options: Any) -> Callable[[Request], Awaitable[Response]]:
        @idempotent(release_statuses=answering_a_coroutine, **options)
        async def pay(request: Request) -> Response:
            nonlocal runs
            runs += 1
            return JSONResponse({}, status_code=201)

        return pay

    routes = [
        Route("/pay", counted(key_format=answering_a_coroutine), methods=["POST"]),
        Route("/charge", counted(), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    guarded = IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: "t")
    async with make_client(guarded, raise_app_exceptions=False) as client:
        refused = await client.post("/pay", headers={"Idempotency-Key": "k1"})
        assert refused.status_code == 500  # ConfigurationError: key_format returned an awaitable
        assert runs == 0
        for _ in range(2):
            assert (
                await client.post("/charge", headers={"Idempotency-Key": "k1"})
            ).status_code == 201
    assert runs == 1
    assert "release_statuses returned an awaitable" in caplog.text
