"""Calling the app in-process, without a server: scope, receive and send built by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Message

from bench.requests import BODY, PAYMENT_PATH

_HEADERS = (
    (b"host", b"127.0.0.1:8000"),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BODY)).encode("latin-1")),
)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes


async def call(app: ASGIApp, *, key: str) -> Reply:
    """One ``POST /payments`` through ``app``; the body arrives in one ``http.request``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": PAYMENT_PATH,
        "raw_path": PAYMENT_PATH.encode("latin-1"),
        "root_path": "",
        "query_string": b"",
        "headers": [*_HEADERS, (b"idempotency-key", key.encode("latin-1"))],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent_body = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent_body
        if sent_body:
            return {"type": "http.disconnect"}
        sent_body = True
        return {"type": "http.request", "body": BODY}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Reply(status, b"".join(chunks))


@asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[FastAPI]:
    """Run the app's lifespan around the block (stores connect and close there)."""
    async with app.router.lifespan_context(app):
        yield app
