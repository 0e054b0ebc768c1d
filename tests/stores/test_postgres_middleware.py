"""The middleware over a real PostgreSQL that goes down and comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, PostgresStore, idempotent, storage_key
from starlette_idempotency.stores.base import take_back
from starlette_idempotency.testing._postgres_server import PostgresServer
from tests.support.conditions import eventually
from tests.support.guarded import make_client
from tests.support.link_proxy import LinkProxy
from tests.support.records import pending
from tests.support.stores import equals

pytestmark = pytest.mark.postgres


@contextlib.asynccontextmanager
async def behind_a_link(
    postgres_dsn: str, postgres_table: str
) -> AsyncIterator[tuple[LinkProxy, PostgresStore]]:
    """A store of one connection whose link the test can hold (replies wait) and release."""
    parts = urlsplit(postgres_dsn)
    async with LinkProxy(parts.port or 5432, parts.hostname or "127.0.0.1") as link:
        store = await PostgresStore.connect(
            link.proxied(postgres_dsn), table=postgres_table, min_size=1, max_size=1
        )
        try:
            await store.create_schema()
            yield link, store
        finally:
            await store.aclose()


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


async def test_an_acquire_that_commits_as_the_deadline_fires_is_undone(
    postgres_dsn: str, postgres_table: str
) -> None:
    """The acquire's INSERT commits, but its reply comes after ``store_timeout_seconds``: the
    client gets 503 "retry later", and the retry must be able to run (it was answered 409 for
    the whole lock TTL before: the lock of a request that never ran)."""
    runs: list[int] = []

    @idempotent(lock_ttl_seconds=30)
    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"n": len(runs)}, status_code=201)

    async with behind_a_link(postgres_dsn, postgres_table) as (link, store):
        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        middleware = IdempotencyMiddleware(app, store=store, store_timeout_seconds=0.5)
        client = make_client(middleware)

        async def post(key: str) -> int:
            response = await client.post("/pay", json={}, headers={"Idempotency-Key": key})
            return response.status_code

        assert await post("warm") == 201  # the statements are prepared: one exchange each
        link.hold()  # the INSERT runs and commits; its reply is late
        asyncio.get_running_loop().call_later(1.0, link.release)
        assert await post("late") == 503
        assert runs == [1]
        row = await store.get(storage_key("", "POST", "/pay", "late"))
        assert row is not None, "the INSERT did not commit: nothing to undo"

        await eventually(lambda: equals(post("late"), 201), message="a retry to run (not 409)")
        assert runs == [1, 1]


async def test_a_take_back_that_commits_as_the_deadline_fires_is_not_undone(
    postgres_dsn: str, postgres_table: str
) -> None:
    """A handler whose lock vanished takes its key back with its own owner token; a take-back
    whose reply comes after the deadline committed all the same, and must stay: undone (fenced
    by the same token), it would free the key of a handler that still runs."""
    async with behind_a_link(postgres_dsn, postgres_table) as (link, store):
        running = pending("k", "handler")
        assert (await store.try_acquire("k", running, 30)).acquired
        assert await store.release("k", "handler")  # the lock vanished
        link.hold()  # the take-back runs and commits; its reply is late
        asyncio.get_running_loop().call_later(1.0, link.release)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await take_back(store, "k", running, 30)
        assert not store._undoing, "an undo was made for a take-back"

        async def back() -> bool:
            held = await store.get("k")
            return held is not None and held.owner_token == "handler"

        await eventually(back, message="the take-back to be read back once the link flows")
        assert not (await store.try_acquire("k", pending("k", "retry"), 30)).acquired
