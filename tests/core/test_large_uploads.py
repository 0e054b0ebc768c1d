"""A large upload is held once: the chunks a server hands the middleware are gathered in one
buffer, which the fingerprint reads in place, and handed to the app in chunks again, so the
app's parser streams them rather than holding a second whole copy."""

from __future__ import annotations

import tracemalloc
import uuid
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._lease import REPLAY_CHUNK_BYTES
from starlette_idempotency._types import ASGIApp, Message, Receive, Scope, Send
from tests.core.test_fingerprint_multipart import content_type, encode
from tests.support.asgi import post_scope

SIZE = 50 * 1024 * 1024
SERVER_CHUNK = 64 * 1024  # what uvicorn hands on at a time


def upload_app(received: list[int]) -> Starlette:
    @idempotent()
    async def upload(request: Request) -> Response:
        async with request.form() as form:
            file = form["file"]
            assert isinstance(file, UploadFile)
            size = file.size
        return JSONResponse({"size": size}, status_code=201)

    class Counting:
        """Between the middleware and the router: the sizes of the messages the app gets."""

        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            async def counted() -> Message:
                message = await receive()
                received.append(len(message.get("body", b"")))
                return message

            await self.app(scope, counted, send)

    app = Starlette(routes=[Route("/uploads", upload, methods=["POST"])])
    app.add_middleware(Counting)
    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        max_body_bytes=64 * 1024 * 1024,
        key_scope=lambda _: "t",
    )
    return app


def upload_scope(media_type: str, length: int, key: str) -> Scope:
    return post_scope(
        "/uploads",
        [
            (b"content-type", media_type.encode()),
            (b"content-length", str(length).encode()),
            (b"idempotency-key", key.encode()),
        ],
    )


async def call(app: Starlette, scope: Scope, pieces: Iterator[bytes]) -> list[Message]:
    """Call ``app`` as a server does: a message per piece, each made when it is read; what
    the app sent."""
    pending = next(pieces, None)
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal pending
        if pending is None:
            return {"type": "http.disconnect"}
        piece, pending = pending, next(pieces, None)
        return {"type": "http.request", "body": piece, "more_body": pending is not None}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def split(body: bytes, size: int) -> Iterator[bytes]:
    return (body[at : at + size] for at in range(0, len(body), size))


async def post(app: Starlette, body: bytes, boundary: str) -> tuple[int, list[Message]]:
    """POST ``body`` in chunks as uvicorn hands them on; the peak of traced memory."""
    scope = upload_scope(content_type(boundary), len(body), uuid.uuid4().hex)
    tracemalloc.start()
    try:
        sent = await call(app, scope, split(body, SERVER_CHUNK))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, sent


async def test_a_50_mb_upload_is_held_once_and_handed_on_in_chunks() -> None:
    body = encode([("file", "big.bin", "application/octet-stream", b"\x01" * SIZE)], "big")
    received: list[int] = []
    peak, sent = await post(upload_app(received), body, "big")
    assert sent[0]["status"] == 201, sent
    assert b'"size":%d' % SIZE in sent[1]["body"]
    assert sum(received) == len(body)
    assert max(received) == REPLAY_CHUNK_BYTES
    assert len(received) > len(body) // REPLAY_CHUNK_BYTES  # in chunks, not one message
    assert peak <= 1.3 * len(body), f"peak {peak / len(body):.2f} times the body"


@idempotent()
async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")


@pytest.mark.parametrize(
    ("media_type", "body"),
    [
        ("application/json", b'{"amount": 1, "note": "' + b"x" * 200 + b'"}'),
        ("application/x-www-form-urlencoded", b"b=2&a=1&note=" + b"x" * 200),
        (
            content_type("m"),
            encode([("a", None, None, b"1"), ("f", "f.txt", None, b"x" * 200)], "m"),
        ),
        ("text/plain; charset=latin-1", b"caf\xe9" * 50),
    ],
    ids=["json", "form", "multipart", "text"],
)
async def test_a_body_sent_in_several_messages_is_the_request_sent_in_one(
    media_type: str, body: bytes
) -> None:
    """Gathered in a buffer, it is fingerprinted and handed to the app as the same bytes."""
    app = Starlette(routes=[Route("/uploads", echo, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda _: "t")
    key = uuid.uuid4().hex
    scope = upload_scope(media_type, len(body), key)
    answers = [await call(app, scope, split(body, size)) for size in (len(body), 7)]
    first, retry = answers
    assert first[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in first[1:]) == body
    assert (b"x-idempotent-replay", b"true") in retry[0]["headers"]
