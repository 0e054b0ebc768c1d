"""Calling an ASGI app in-process, without a server: scope, receive and send built by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Message

from bench.requests import PAYMENT_PATH, REQUEST_BODY

_BASE_HEADERS = (
    (b"host", b"127.0.0.1:8000"),
    (b"content-type", b"application/json"),
)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def call(
    app: ASGIApp,
    *,
    key: str | None,
    method: str = "POST",
    path: str = PAYMENT_PATH,
    body: bytes = REQUEST_BODY,
    query: bytes = b"",
) -> Reply:
    """One request through ``app``; the body arrives in one ``http.request`` message."""
    if method == "POST":
        headers = [*_BASE_HEADERS, (b"content-length", str(len(body)).encode("latin-1"))]
    else:
        headers = [(b"host", b"127.0.0.1:8000")]
    if key is not None:
        headers.append((b"idempotency-key", key.encode("latin-1")))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("latin-1"),
        "root_path": "",
        "query_string": query,
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent_body = False
    status = 0
    response_headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if sent_body:
            return {"type": "http.disconnect"}
        sent_body = True
        return {"type": "http.request", "body": body if method == "POST" else b""}

    async def send(message: Message) -> None:
        nonlocal status, response_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            response_headers = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Reply(status, response_headers, b"".join(chunks))


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[FastAPI]:
    """Run the app's lifespan around the block (stores connect and close there)."""
    async with app.router.lifespan_context(app):
        yield app
