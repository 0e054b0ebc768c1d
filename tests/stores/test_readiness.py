"""The readiness check and route against a real Redis and PostgreSQL: ready while the store
works, 503 with the cause when it is unreachable, silent, or its table is missing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from starlette_idempotency import (
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    RedisStore,
    idempotent,
    readiness_endpoint,
    readiness_route,
    store_ready,
)
from starlette_idempotency.stores import AcquireResult, IdempotencyRecord
from starlette_idempotency.stores._round_trip import RoundTrip
from starlette_idempotency.testing._processes import free_port


@idempotent()
async def create(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True}, status_code=201)


def app_with(store: Any) -> Starlette:
    """An app guarded by ``store``, with its readiness route at /ready."""
    app = Starlette(routes=[Route("/things", create, methods=["POST"]), readiness_route(store)])
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


async def probe(app: Any, path: str = "/ready") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://pod") as client:
        return await client.get(path)


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A port that accepts connections and never answers (a frozen server)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.redis
async def test_redis_up_is_ready(redis_store: RedisStore) -> None:
    response = await probe(app_with(redis_store))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ready"
    assert body["store"] == redis_store.describe()
    assert "errors" not in body
    assert isinstance(body["warnings"], list)
    assert response.headers["cache-control"] == "no-store"


@pytest.mark.redis
async def test_redis_unreachable_is_503_with_the_cause() -> None:
    port = free_port()
    store = RedisStore.from_url(f"redis://:s3cret@127.0.0.1:{port}/0")
    try:
        response = await probe(app_with(store))
    finally:
        await store.aclose()
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready"
    assert body["store"] == f"redis at 127.0.0.1:{port}/0"
    [error] = body["errors"]
    assert error.startswith(f"redis at 127.0.0.1:{port}/0 is unreachable")
    assert "s3cret" not in response.text


@pytest.mark.redis
async def test_a_silent_redis_is_not_ready_within_the_timeout(silent_port: int) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{silent_port}/0")
    try:
        started = asyncio.get_running_loop().time()
        readiness = await store_ready(store, timeout=0.3)
        elapsed = asyncio.get_running_loop().time() - started
    finally:
        await store.aclose()
    assert not readiness
    assert readiness.errors == (
        f"redis at 127.0.0.1:{silent_port}/0 is unreachable: no answer within 0.3s",
    )
    assert elapsed < 2


@pytest.mark.postgres
async def test_postgres_with_its_table_is_ready(postgres_store: PostgresStore) -> None:
    response = await probe(app_with(postgres_store))
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "ready"


@pytest.mark.postgres
async def test_postgres_without_its_table_is_503(postgres_dsn: str, postgres_table: str) -> None:
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table)
    try:
        missing = await probe(app_with(store))
        await store.create_schema()
        migrated = await probe(app_with(store))
    finally:
        await store.aclose()
    assert missing.status_code == 503
    [error] = missing.json()["errors"]
    assert f"table {postgres_table}" in error
    assert "does not exist: run `starlette-idempotency migrate`" in error
    assert migrated.status_code == 200, migrated.text


@pytest.mark.postgres
async def test_postgres_unreachable_is_503() -> None:
    port = free_port()
    store = PostgresStore.from_dsn(f"postgresql://app:s3cret@127.0.0.1:{port}/payments")
    try:
        response = await probe(app_with(store))
    finally:
        await store.aclose()
    assert response.status_code == 503
    [error] = response.json()["errors"]
    assert error.startswith(f"postgres at 127.0.0.1:{port}/payments table idempotency_keys is")
    assert "s3cret" not in response.text


async def test_a_store_without_a_pool_is_not_ready_and_says_why() -> None:
    readiness = await store_ready(PostgresStore(table="payments_keys"))
    assert not readiness.ready
    assert "has no pool" in readiness.errors[0]
    assert readiness.store == "postgres (no pool handed over yet) table payments_keys"


async def test_the_memory_store_is_ready() -> None:
    response = await probe(app_with(MemoryStore()))
    assert response.status_code == 200
    assert response.json() == {
        "status": "ready",
        "store": "memory (this process only)",
        "warnings": [],
    }


@pytest.mark.redis
async def test_fastapi_mounts_it_either_way_outside_the_schema(redis_store: RedisStore) -> None:
    app = FastAPI()
    app.router.routes.append(readiness_route(redis_store, path="/ready"))
    app.add_api_route("/readyz", readiness_endpoint(redis_store), include_in_schema=False)
    for path in ("/ready", "/readyz"):
        response = await probe(app, path)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "ready"
    assert app.openapi()["paths"] == {}


def test_the_route_answers_get_and_head() -> None:
    route = readiness_route(MemoryStore(), path="/healthz/ready")
    assert route.path == "/healthz/ready"
    assert route.methods == {"GET", "HEAD"}
    assert route.name == "idempotency_readiness"


class CountingStore(MemoryStore):
    """Counts the acquires: the round trip makes one each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.acquires = 0

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.acquires += 1
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)


async def test_the_round_trip_runs_again_after_a_requests_operation_failed_only() -> None:
    """An operation claim that fails every 5 s (a schema from before the claims) would have
    every probe do three writes for as long as it fails; a failed acquire or write says
    requests fail too."""
    store = CountingStore()
    round_trip = RoundTrip(store, "advice", 2.0)
    assert await round_trip.finding("memory") is None
    round_trip.failed("claim_operation")
    round_trip.failed("purge_expired")
    assert await round_trip.finding("memory") is None
    assert store.acquires == 1
    round_trip.failed("finish")
    assert await round_trip.finding("memory") is None
    assert store.acquires == 2
