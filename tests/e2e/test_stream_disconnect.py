"""A client that hangs up mid-stream, through real uvicorn (h11 and httptools).

Once the app has started a 2xx/3xx/4xx response the outcome is decided: a retry with the same
key is a replay (without the body the first client never got whole), never a second run.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator

import httpx
import pytest

from tests.support.conditions import eventually
from tests.support.uvicorn import HttpImplementation, UvicornServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["h11", "httptools"])
def server(request: pytest.FixtureRequest) -> Iterator[UvicornServer]:
    http: HttpImplementation = request.param
    with UvicornServer("tests.e2e.apps.streaming:app", http=http) as running:
        yield running


async def hang_up_mid_stream(port: int, key: str, query: str = "") -> bytes:
    """POST, read the status line and a few body chunks, then reset the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"amount": 1}'
    writer.write(
        f"POST /stream{query} HTTP/1.1\r\nHost: test\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    received = b""
    async with asyncio.timeout(10):
        while len(received) < 8 * 1024:
            chunk = await reader.read(4096)
            assert chunk, "the server closed the connection before streaming"
            received += chunk
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
    writer.close()
    return received


async def settled_retry(client: httpx.AsyncClient, key: str, query: str = "") -> httpx.Response:
    """Retry until the first request's outcome is settled (no longer 409 in progress)."""

    async def settled() -> httpx.Response | None:
        response = await client.post(
            f"/stream{query}", json={"amount": 1}, headers={"Idempotency-Key": key}
        )
        return None if response.status_code == 409 else response

    return await eventually(
        settled, timeout=15, interval=0.05, message="the first request's outcome"
    )


async def test_retry_after_a_hang_up_is_a_replay_not_a_second_run(server: UvicornServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        before = (await client.get("/count")).json().get("stream", 0)
        key = f"hang-up-{server.http}"
        received = await hang_up_mid_stream(server.port, key)
        assert received.startswith(b"HTTP/1.1 200")
        retry = await settled_retry(client, key)
        assert retry.status_code == 200
        assert retry.headers["x-idempotent-replay"] == "true"
        # Either the whole body was captured, or it is marked as omitted: never a truncated
        # body presented as whole.
        if retry.headers.get("x-idempotent-body-omitted") != "true":
            assert len(retry.content) == 200 * 1024
        assert (await client.get("/count")).json()["stream"] == before + 1


async def test_a_5xx_stream_cut_short_frees_the_key(server: UvicornServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        before = (await client.get("/count")).json().get("stream", 0)
        key = f"hang-up-5xx-{server.http}"
        await hang_up_mid_stream(server.port, key, "?status=503")
        retry = await settled_retry(client, key, "?status=503")
        assert "x-idempotent-replay" not in retry.headers
        assert (await client.get("/count")).json()["stream"] == before + 2
