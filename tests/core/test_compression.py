"""A compressing middleware inside this one: warned about once it compresses, and a replay
never hands a client an encoding it did not accept."""

from __future__ import annotations

import gzip
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._record import StoredResponse
from starlette_idempotency._responses import replay_for

TEXT = b"a compressible answer " * 100


class Squeeze(GZipMiddleware):
    """A compressing middleware whose name says nothing of compression."""


def build(order: str, compressor: type[GZipMiddleware] = GZipMiddleware) -> Starlette:
    @idempotent()
    async def report(request: Request) -> Response:
        return Response(TEXT, media_type="text/plain")

    app = Starlette(routes=[Route("/report", report, methods=["POST"])])
    # Starlette runs the middleware added last outermost.
    if order == "idempotency-inside":
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
        app.add_middleware(compressor, minimum_size=10)
    else:
        app.add_middleware(compressor, minimum_size=10)
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
    return app


async def post(app: Starlette, accept_encoding: str | None, key: str = "k") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        request = client.build_request("POST", "/report", headers={"Idempotency-Key": key})
        del request.headers["accept-encoding"]  # httpx's default accepts everything
        if accept_encoding is not None:
            request.headers["accept-encoding"] = accept_encoding
        return await client.send(request)


@pytest.mark.parametrize("order", ["idempotency-inside", "idempotency-outside"])
@pytest.mark.parametrize("second", [None, "identity", "br"])
async def test_a_client_that_does_not_accept_gzip_gets_plain_text(
    order: str, second: str | None
) -> None:
    app = build(order)
    first = await post(app, "gzip")
    assert first.headers["content-encoding"] == "gzip"
    replay = await post(app, second)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert "content-encoding" not in replay.headers
    assert replay.content == TEXT


@pytest.mark.parametrize("order", ["idempotency-inside", "idempotency-outside"])
async def test_a_client_that_accepts_gzip_gets_gzip(order: str) -> None:
    app = build(order)
    await post(app, "gzip")
    replay = await post(app, "gzip, br")
    assert replay.headers["content-encoding"] == "gzip"
    assert replay.content == TEXT  # httpx decoded the gzip


@pytest.mark.parametrize(
    ("accept_encoding", "accepted"),
    [("gzip", True), ("GZIP;q=0.5", True), ("*", True), ("gzip;q=0", False), ("", False)],
)
def test_accept_encoding_is_read_with_its_quality(accept_encoding: str, accepted: bool) -> None:
    stored = StoredResponse(200, (("content-encoding", "gzip"),), gzip.compress(TEXT))
    replay = replay_for(stored, [(b"accept-encoding", accept_encoding.encode())])
    assert (replay is stored) is accepted
    assert replay.body == stored.body if accepted else replay.body == TEXT


@pytest.mark.parametrize("compressor", [GZipMiddleware, Squeeze])
async def test_a_compressing_layer_inside_is_warned_about_once_by_what_it_does(
    compressor: type[GZipMiddleware], caplog: pytest.LogCaptureFixture
) -> None:
    """Found by the encoded responses it hands the middleware, whatever its class's name."""
    app = build("idempotency-outside", compressor)
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        await post(app, "identity", key="plain")  # not compressed: nothing to say yet
        assert not caplog.records
        await post(app, "gzip", key="first")
        await post(app, "gzip", key="second")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "with Content-Encoding: gzip" in warnings[0]
    assert "add IdempotencyMiddleware before it" in warnings[0]


async def test_the_right_order_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    app = build("idempotency-inside")
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        first = await post(app, "gzip")
    assert first.headers["content-encoding"] == "gzip"
    assert not caplog.records


def test_an_encoding_that_cannot_be_decoded_is_replayed_without_its_body() -> None:
    stored = StoredResponse(
        200,
        (("content-type", "text/plain"), ("content-encoding", "br"), ("content-length", "3")),
        b"\x0b\x01\x80",
    )
    replay = replay_for(stored, [(b"accept-encoding", b"gzip")])
    assert replay.body == b""
    assert dict(replay.headers) == {"x-idempotent-body-omitted": "true"}
    assert replay_for(stored, [(b"accept-encoding", b"br")]) is stored


def test_a_corrupt_gzip_body_is_replayed_without_its_body() -> None:
    stored = StoredResponse(200, (("content-encoding", "gzip"),), gzip.compress(TEXT)[:-8])
    assert replay_for(stored, []).headers == (("x-idempotent-body-omitted", "true"),)
