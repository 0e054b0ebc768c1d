"""Every way a guarded response can end early, driven through the ASGI interface.

Rule: once the app has started a 2xx/3xx/4xx response, the outcome is decided and the key never
becomes free through that path. A body that could not be captured whole is stored as omitted
(``X-Idempotent-Body-Omitted: true``), never replayed truncated as if whole.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.asgi import post_json
from tests.support.conditions import eventually

Message = MutableMapping[str, Any]
BODY = b'{"amount": 1}'


def build_app(executions: Counter[str], release: asyncio.Event) -> Starlette:
    @idempotent()
    async def stream(request: Request) -> Response:
        executions["stream"] += 1
        status = int(request.query_params.get("status", "200"))
        mode = request.query_params.get("mode", "")

        async def body() -> AsyncIterator[bytes]:
            yield b"first,"
            if mode == "raise":
                raise RuntimeError("the generator failed half-way")
            await release.wait()
            yield b"last"

        return StreamingResponse(body(), status_code=status, media_type="text/plain")

    app = Starlette(routes=[Route("/stream", stream, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
    return app


def scope(query: str = "", spec_version: str = "2.4") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": query.encode(),
        "headers": [
            (b"host", b"testserver"),
            (b"idempotency-key", b"k1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }


class Client:
    """One ASGI connection: the body once, then ``http.disconnect`` when ``gone`` is set."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self._body_sent = False

    async def receive(self) -> Message:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def body_chunks(self) -> int:
        return sum(1 for m in self.sent if m["type"] == "http.response.body")


def arranged() -> tuple[Counter[str], asyncio.Event, Starlette, Client]:
    """A fresh app (with its run counter and the event that releases its bodies) and a client
    connection to it."""
    executions: Counter[str] = Counter()
    release = asyncio.Event()
    return executions, release, build_app(executions, release), Client()


async def retry(app: Starlette, release: asyncio.Event, query: str = "") -> httpx.Response:
    """The client's retry, once the first attempt is over (a second run would finish too)."""
    release.set()
    return await post_json(app, f"/stream{query}", BODY)


def assert_replayed_without_body(response: httpx.Response, executions: Counter[str]) -> None:
    assert response.status_code == 200
    assert response.headers["x-idempotent-replay"] == "true"
    assert response.headers["x-idempotent-body-omitted"] == "true"
    assert response.content == b""
    assert executions["stream"] == 1


@pytest.mark.parametrize("error", [OSError("connection reset"), ClientDisconnect()])
async def test_send_raising_mid_stream_keeps_the_outcome(error: Exception) -> None:
    executions, release, app, client = arranged()

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            raise error
        await client.send(message)

    with pytest.raises((OSError, ClientDisconnect)):
        await app(scope(), client.receive, send)
    assert_replayed_without_body(await retry(app, release), executions)


async def test_app_that_stops_on_http_disconnect_keeps_the_outcome() -> None:
    executions, release, app, client = arranged()
    # Before ASGI spec 2.4, StreamingResponse listens for http.disconnect and stops its body.
    running = asyncio.create_task(app(scope(spec_version="2.0"), client.receive, client.send))
    await eventually(lambda: client.body_chunks() >= 1, message="the first chunk")
    client.gone.set()
    await asyncio.wait_for(running, 5)
    assert client.sent[-1].get("more_body") is True  # the body never finished
    assert_replayed_without_body(await retry(app, release), executions)


async def test_cancelled_request_task_keeps_the_outcome() -> None:
    executions, release, app, client = arranged()
    running = asyncio.create_task(app(scope(), client.receive, client.send))
    await eventually(lambda: client.body_chunks() >= 1, message="the first chunk")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert_replayed_without_body(await retry(app, release), executions)


async def test_app_raising_after_its_response_started_keeps_the_outcome() -> None:
    executions, release, app, client = arranged()
    with pytest.raises(RuntimeError):
        await app(scope("mode=raise"), client.receive, client.send)
    assert_replayed_without_body(await retry(app, release, "?mode=raise"), executions)


async def test_a_5xx_cut_short_frees_the_key() -> None:
    executions, release, app, client = arranged()
    running = asyncio.create_task(app(scope("status=503"), client.receive, client.send))
    await eventually(lambda: client.body_chunks() >= 1, message="the first chunk")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    response = await retry(app, release, "?status=503")
    assert response.status_code == 503
    assert "x-idempotent-replay" not in response.headers
    assert executions["stream"] == 2


async def test_a_finished_stream_is_replayed_whole() -> None:
    executions: Counter[str] = Counter()
    release = asyncio.Event()
    release.set()
    app = build_app(executions, release)
    client = Client()
    await app(scope(), client.receive, client.send)
    assert executions["stream"] == 1
    response = await retry(app, release)
    assert response.headers["x-idempotent-replay"] == "true"
    assert "x-idempotent-body-omitted" not in response.headers
    assert response.content == b"first,last"
