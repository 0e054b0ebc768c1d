"""The middleware over a real PostgreSQL that goes down and comes back."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, PostgresStore, idempotent
from starlette_idempotency.testing._postgres_server import PostgresServer
from tests.support.guarded import make_client

pytestmark = pytest.mark.postgres


async def test_stopped_postgres_fails_closed_and_recovers_without_restart(
    private_postgres: PostgresServer,
) -> None:
    runs: list[int] = []

    @idempotent()
    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"n": len(runs)}, status_code=201)

    store = await PostgresStore.connect(private_postgres.dsn, operation_timeout=2.0)
    try:
        await store.create_schema()
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        client = make_client(IdempotencyMiddleware(app, store=store, store_timeout_seconds=3.0))

        async def post(key: str) -> int:
            response = await client.post("/pay", json={}, headers={"Idempotency-Key": key})
            return response.status_code

        assert await post("before") == 201
        private_postgres.stop()
        assert await post("during") == 503
        assert runs == [1]
        private_postgres.start()
        assert await post("during") == 201
        assert await post("before") == 201  # a replay, from the same table
        assert runs == [1, 1]
    finally:
        await store.aclose()
