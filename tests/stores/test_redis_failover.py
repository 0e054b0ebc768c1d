"""A failover right after a response, on a real primary and replica.

Redis replicates asynchronously. With ``wait_replicas``, the acquire was already ``WAIT``-ed
for; the stored response is too, before the client gets the response's last byte, so a replica
promoted the moment the client has its answer knows it, and a retry gets the replay instead of
running the handler again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, RedisStore, idempotent
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.conditions import eventually
from tests.support.guarded import make_client
from tests.support.link_proxy import LinkProxy

pytestmark = pytest.mark.redis

HEADERS = {"Idempotency-Key": "order-1"}
#: How long the replication link lags once the handler has answered.
LAG_SECONDS = 0.5


@pytest.fixture
async def replicated() -> AsyncIterator[tuple[RedisServer, LinkProxy, RedisServer]]:
    """A primary, and a replica of it that hears it through a :class:`LinkProxy`."""
    with RedisServer() as primary:
        async with LinkProxy(primary.port) as link:
            with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(link.port)]) as replica:
                # Polled from this loop, which runs the proxy the replica syncs through.
                await eventually(
                    lambda: b"master_link_status:up" in replica.command("INFO", "replication"),
                    timeout=30,
                    message="the replica to sync",
                )
                yield primary, link, replica


async def test_a_failover_right_after_the_response_keeps_the_stored_response(
    replicated: tuple[RedisServer, LinkProxy, RedisServer],
) -> None:
    primary, link, replica = replicated
    runs = 0

    @idempotent(lock_ttl_seconds=30)
    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        link.hold()  # the replica lags from here: the stored response reaches it late
        asyncio.get_running_loop().call_later(LAG_SECONDS, link.release)
        return JSONResponse({"run": runs}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = aioredis.from_url(primary.url)
    promoted_client = aioredis.from_url(replica.url)
    store = RedisStore(client, key_prefix="p", wait_replicas=1, wait_timeout_ms=10_000)
    try:
        first = await make_client(IdempotencyMiddleware(app, store=store)).post(
            "/pay", json={}, headers=HEADERS
        )
        assert first.status_code == 201
        # The primary fails the moment the client has its answer; the replica takes over.
        await link.cut()
        replica.command("REPLICAOF", "NO", "ONE")
        promoted = RedisStore(promoted_client, key_prefix="p")
        retry = await make_client(IdempotencyMiddleware(app, store=promoted)).post(
            "/pay", json={}, headers=HEADERS
        )

        assert retry.status_code == 201, retry.text
        assert retry.headers.get("x-idempotent-replay") == "true"
        assert retry.json() == {"run": 1}
        assert runs == 1
    finally:
        await client.aclose()
        await promoted_client.aclose()
