"""Through the middleware: awkward bodies never share a fingerprint, and never give a 5xx the
bare app would not give, in every fingerprint mode, on FastAPI and on Starlette."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from typing import Any

import pytest
from fastapi import Body, FastAPI, Form
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client, unguarded

MODES: dict[str, dict[str, Any]] = {
    "raw": {},
    "exclude_fields": {"exclude_fields": ["nonce"]},
    "validated": {"fingerprint": "validated", "exclude_fields": ["nonce"]},
}
JSON = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}
MULTIPART = {"content-type": "multipart/form-data; boundary=b"}
MULTIPART_BODY = b'--b\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n--b--\r\n'


class Doc(BaseModel):
    data: Any = None
    name: str = ""
    amount: int = 0
    nonce: int = 0


class Measure(BaseModel):
    value: float


def build_fastapi(mode: str, runs: Counter[str]) -> FastAPI:
    guard = idempotent(**MODES[mode])
    app = FastAPI()

    @app.post("/doc")
    @guard
    async def doc(body: Doc) -> dict[str, int]:
        runs["doc"] += 1
        return {"n": runs["doc"]}

    @app.post("/measure")
    @guard
    async def measure(body: Measure) -> dict[str, int]:
        runs["measure"] += 1
        return {"n": runs["measure"]}

    @app.post("/text")
    @guard
    async def text(body: str = Body()) -> dict[str, int]:
        runs["text"] += 1
        return {"n": len(body)}

    @app.post("/raw")
    @guard
    async def raw(request: Request) -> dict[str, int]:
        runs["raw"] += 1
        return {"n": len(await request.body())}

    @app.post("/form")  # python-multipart (the test group) parses it
    @guard
    async def form(name: str = Form(), nonce: str = Form("")) -> dict[str, int]:
        runs["form"] += 1
        return {"n": runs["form"]}

    return app


def build_starlette(mode: str, runs: Counter[str]) -> Starlette:
    guard = idempotent(**MODES[mode])

    @guard
    async def doc(request: Request) -> JSONResponse:
        await request.json()
        runs["doc"] += 1
        return JSONResponse({"n": runs["doc"]})

    @guard
    async def raw(request: Request) -> JSONResponse:
        runs["raw"] += 1
        return JSONResponse({"n": len(await request.body())})

    async def form(request: Request) -> JSONResponse:
        await request.form()
        runs["form"] += 1
        return JSONResponse({"n": runs["form"]})

    return Starlette(
        routes=[
            Route("/doc", doc, methods=["POST"]),
            Route("/raw", raw, methods=["POST"]),
            Route("/form", guard(form), methods=["POST"]),
        ]
    )


BUILDERS = {"fastapi": build_fastapi, "starlette": build_starlette}


class Apps:
    """One app with the middleware and the same app without it, to compare answers."""

    def __init__(self, kind: str, mode: str) -> None:
        self.runs: Counter[str] = Counter()
        guarded = BUILDERS[kind](mode, self.runs)
        guarded.add_middleware(IdempotencyMiddleware, store=MemoryStore())
        # Both answer an app's own exception (a body it cannot parse) with a 500: compared.
        self.client = make_client(guarded, raise_app_exceptions=False)
        self.bare = make_client(
            unguarded(BUILDERS[kind](mode, Counter())), raise_app_exceptions=False
        )
        self.keys = 0

    async def post(self, path: str, body: bytes, headers: dict[str, str], key: str = "") -> Any:
        self.keys += 1
        key_header = {"Idempotency-Key": key or f"k{self.keys}"}
        return await self.client.post(path, content=body, headers={**headers, **key_header})


@pytest.fixture(params=sorted(BUILDERS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=sorted(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (1180591620717411303424, 1180591620717411304424),
        (2**64, 2**64 + 1),
        (-(2**63) - 1, -(2**63) - 2),
    ],
)
async def test_big_integers_with_one_key_are_a_mismatch(
    kind: str, mode: str, first: int, second: int
) -> None:
    apps = Apps(kind, mode)
    assert (await apps.post("/doc", b'{"amount": %d}' % first, JSON, "k")).status_code == 200
    again = await apps.post("/doc", b'{"amount": %d}' % second, JSON, "k")
    assert again.status_code == 422
    assert "x-idempotent-replay" not in again.headers
    assert apps.runs["doc"] == 1


async def test_an_integer_and_its_float_are_two_requests(kind: str, mode: str) -> None:
    apps = Apps(kind, mode)
    await apps.post("/doc", b'{"amount": 18446744073709551616}', JSON, "k")
    again = await apps.post("/doc", b'{"amount": 18446744073709551616.0}', JSON, "k")
    assert again.status_code == 422  # a mismatch, or the model refusing the float
    assert "x-idempotent-replay" not in again.headers
    assert apps.runs["doc"] == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [(b"NaN", b"Infinity"), (b"Infinity", b"-Infinity"), (b"NaN", b"-Infinity")],
)
async def test_nan_and_infinities_are_a_mismatch_in_validated_mode(
    first: bytes, second: bytes
) -> None:
    apps = Apps("fastapi", "validated")
    assert (await apps.post("/measure", b'{"value": %s}' % first, JSON, "k")).status_code == 200
    again = await apps.post("/measure", b'{"value": %s}' % second, JSON, "k")
    assert again.status_code == 422
    assert apps.runs["measure"] == 1


AWKWARD = [
    pytest.param("/raw", nested(300), JSON, id="raw-depth-300"),
    pytest.param("/raw", nested(900), JSON, id="raw-depth-900"),
    pytest.param("/raw", nested(5000), JSON, id="raw-depth-5000"),
    pytest.param("/raw", b'{"nonce": ' + nested(900) + b"}", JSON, id="raw-excluded-depth-900"),
    pytest.param("/raw", b'["\\ud800"]', JSON, id="raw-lone-surrogate"),
    pytest.param("/raw", b"a=1&b=%FF&c", FORM, id="raw-form"),
    pytest.param("/raw", MULTIPART_BODY, MULTIPART, id="raw-multipart"),
    pytest.param("/doc", b'{"data": ' + nested(300) + b"}", JSON, id="doc-depth-300"),
    pytest.param("/doc", b'{"name": "\\ud800"}', JSON, id="doc-lone-surrogate"),
    pytest.param("/doc", b'{"amount": 1180591620717411303424}', JSON, id="doc-big-int"),
    pytest.param("/doc", b'{"data": [NaN, Infinity]}', JSON, id="doc-nan"),
    pytest.param("/doc", b"amount=1", FORM, id="doc-form"),
    pytest.param("/doc", MULTIPART_BODY, MULTIPART, id="doc-multipart"),
    pytest.param("/doc", b'{"amount": 1}', {}, id="doc-no-content-type"),
    pytest.param("/text", b'{"a": 1}', {"content-type": "text/plain"}, id="text-plain"),
    pytest.param("/text", b'"a"', JSON, id="text-json"),
    pytest.param("/form", b"name=x&nonce=1", FORM, id="form-urlencoded"),
    pytest.param("/form", MULTIPART_BODY, MULTIPART, id="form-multipart"),
]


@pytest.mark.parametrize(("path", "body", "headers"), AWKWARD)
async def test_awkward_bodies_get_the_answer_the_bare_app_gives(
    kind: str, mode: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    if path == "/text" and kind == "starlette":
        pytest.skip("a FastAPI body type")
    apps = Apps(kind, mode)
    bare = await apps.bare.post(path, content=body, headers=headers)
    guarded = await apps.post(path, body, headers)
    assert guarded.status_code // 100 == bare.status_code // 100, guarded.text
    if guarded.status_code < 300:
        replay = await apps.post(path, body, headers, key=f"k{apps.keys}")
        assert replay.headers["x-idempotent-replay"] == "true"


@pytest.mark.parametrize(
    ("path", "first", "second", "changed"),
    [
        ("/raw", b"b=2&nonce=1&c=3&a=1", b"a=1&c=3&b=2&nonce=2", b"a=9&c=3&b=2&nonce=2"),
        ("/form", b"name=x&nonce=1", b"nonce=2&name=x", b"nonce=2&name=y"),
    ],
)
async def test_reordered_form_fields_replay(
    kind: str, mode: str, path: str, first: bytes, second: bytes, changed: bytes
) -> None:
    if mode == "raw":  # nothing excluded: the nonce must match
        first = first.replace(b"nonce=1", b"nonce=2")
    apps = Apps(kind, mode)
    assert (await apps.post(path, first, FORM, "k")).status_code == 200
    replay = await apps.post(path, second, FORM, "k")
    assert replay.headers["x-idempotent-replay"] == "true"
    assert (await apps.post(path, changed, FORM, "k")).status_code == 422
    assert apps.runs[path.strip("/")] == 1


@pytest.mark.parametrize("options", [{}, {"fingerprint_headers": ["content-encoding"]}])
async def test_an_encoded_body_is_compared_as_sent(options: dict[str, Any]) -> None:
    """A gzip body is its compressed bytes to the fingerprint, as documented: a retry that
    compresses afresh (gzip stamps the time) is a 422, never a replay of another request;
    the same bytes again are replayed. ``fingerprint_headers`` tells encodings apart."""
    runs: Counter[str] = Counter()

    @idempotent(**options)
    async def orders(request: Request) -> JSONResponse:
        runs["orders"] += 1
        return JSONResponse(json.loads(gzip.decompress(await request.body())), status_code=201)

    app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    headers = {**JSON, "content-encoding": "gzip", "Idempotency-Key": "k"}
    sent = gzip.compress(b'{"items": [1]}', mtime=1_700_000_000)
    for _ in range(2):
        answer = await client.post("/orders", content=sent, headers=headers)
        assert answer.status_code == 201, answer.text
    assert answer.headers["x-idempotent-replay"] == "true"
    again = gzip.compress(b'{"items": [1]}', mtime=1_700_000_001)
    assert (await client.post("/orders", content=again, headers=headers)).status_code == 422
    identity = {**headers, "content-encoding": "identity"}
    other = await client.post("/orders", content=sent, headers=identity)
    assert other.status_code == (422 if options else 201)
    assert runs["orders"] == 1
