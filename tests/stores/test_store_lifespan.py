"""Stores built at import time, as a FastAPI module builds them, through the app's lifespan:
opened by the startup check in the lifespan's event loop, closed by the middleware when the
lifespan ends when the store opened its connections itself, and left open when the app passed
them in. Starlette's ``TestClient`` runs each ``with`` block in an event loop of its own, so an
app started twice also shows that the second start opens its own connections. Without ``with``
(no lifespan, a loop per request), each loop closes what the store opened in it as it ends.

The servers are the real ones: PostgreSQL's ``pg_stat_activity`` and Redis's ``CLIENT LIST``
count the connections by a name of the test's own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.types import Message

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    PostgresStore,
    RedisStore,
    idempotent,
)
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.redis import DriverName
from starlette_idempotency.testing import FaultyStore
from starlette_idempotency.testing._isolation import delete_prefixed_at, run_admin, unique_prefix
from tests.support.conditions import eventually_sync

ROUNDS = 2  # each start of the app, in a new event loop


@pytest.fixture
def name() -> str:
    return f"lifespan-{uuid.uuid4().hex[:12]}"


def postgres_connections(dsn: str, name: str) -> int:
    count: int = run_admin(
        dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
    )
    return count


def redis_connections(url: str, name: str) -> int:
    async def count() -> int:
        client = aioredis.from_url(url)
        try:
            clients: list[dict[str, Any]] = await client.client_list()
        finally:
            await client.aclose()
        return sum(entry.get("name") == name for entry in clients)

    return asyncio.run(count())


def guarded_app(store: IdempotencyStore, lifespan: Any = None) -> tuple[FastAPI, list[int]]:
    """A FastAPI app as a module builds it, and the runs of its one guarded route."""
    runs: list[int] = []
    app = FastAPI(lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=store, key_scope=lambda request: "t")

    @app.post("/pay")
    @idempotent()
    async def pay() -> dict[str, int]:
        runs.append(1)
        return {"run": len(runs)}

    return app, runs


def pay_twice(client: TestClient, key: str) -> None:
    """The same request twice: the handler runs once, the second gets the stored answer."""
    first = client.post("/pay", headers={"Idempotency-Key": key})
    second = client.post("/pay", headers={"Idempotency-Key": key})
    assert first.status_code == 200, first.text
    assert second.json() == first.json()
    assert second.headers.get("x-idempotent-replay") == "true"


class Lifespan:
    """An app's lifespan run in this event loop, as a server runs it."""

    def __init__(self, app: FastAPI) -> None:
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.messages: list[str] = []
        self.answered = asyncio.Event()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self.task = asyncio.ensure_future(app(scope, self.inbox.get, self._send))

    async def _send(self, message: Message) -> None:
        self.messages.append(message["type"])
        self.answered.set()

    async def step(self, name: str) -> None:
        self.answered.clear()
        await self.inbox.put({"type": f"lifespan.{name}"})
        async with asyncio.timeout(10):
            await self.answered.wait()

    async def stop(self) -> list[str]:
        await self.step("shutdown")
        await self.task
        return self.messages


async def run_lifespan(app: FastAPI, *, stop: bool = True) -> Lifespan:
    """Start ``app`` in this event loop (and stop it, unless told not to)."""
    lifespan = Lifespan(app)
    await lifespan.step("startup")
    if stop:
        await lifespan.stop()
    return lifespan


def schema_lifespan(store: PostgresStore) -> Any:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.create_schema()
        yield

    return lifespan


@pytest.mark.postgres
def test_from_dsn_opens_at_startup_and_closes_when_the_app_stops(
    postgres_dsn: str, postgres_table: str, name: str
) -> None:
    store = PostgresStore.from_dsn(
        postgres_dsn, table=postgres_table, server_settings={"application_name": name}
    )
    app, runs = guarded_app(store, schema_lifespan(store))
    for round_ in range(ROUNDS):
        assert postgres_connections(postgres_dsn, name) == 0
        with TestClient(app) as client:
            assert postgres_connections(postgres_dsn, name) == 1  # the startup opened it
            pay_twice(client, f"key-{round_}")
        assert postgres_connections(postgres_dsn, name) == 0
    assert len(runs) == ROUNDS


@pytest.mark.postgres
async def test_from_dsn_opens_again_when_the_app_starts_again_in_the_same_loop(
    postgres_dsn: str, postgres_table: str, name: str
) -> None:
    """As schemathesis, or tests sharing one event loop, start and stop an app."""
    store = PostgresStore.from_dsn(
        postgres_dsn, table=postgres_table, server_settings={"application_name": name}
    )
    app, runs = guarded_app(store, schema_lifespan(store))
    transport = httpx.ASGITransport(app=app)
    for round_ in range(ROUNDS):
        started = await run_lifespan(app, stop=False)
        assert started.messages == ["lifespan.startup.complete"]
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            key = {"Idempotency-Key": f"key-{round_}"}
            first, retry = [await client.post("/pay", headers=key) for _ in range(2)]
        assert first.status_code == 200, first.text
        assert retry.headers["x-idempotent-replay"] == "true"
        await started.stop()
        assert await asyncio.to_thread(postgres_connections, postgres_dsn, name) == 0
    assert len(runs) == ROUNDS


@pytest.mark.postgres
def test_a_pool_the_app_hands_over_in_its_lifespan_stays_the_apps(
    postgres_dsn: str, postgres_table: str, name: str
) -> None:
    store = PostgresStore(table=postgres_table)
    pools: list[Any] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        options = {"server_settings": {"application_name": name}}
        async with asyncpg.create_pool(postgres_dsn, min_size=1, **options) as pool:
            store.use_pool(pool)
            await store.create_schema()
            yield
            # the app's shutdown runs before the middleware's: the pool still works here
            assert await pool.fetchval("SELECT 1") == 1
            pools.append(pool)

    app, runs = guarded_app(store, lifespan)
    for round_ in range(ROUNDS):
        with TestClient(app) as client:
            pay_twice(client, f"key-{round_}")
        assert postgres_connections(postgres_dsn, name) == 0  # closed by the app, as it said
    assert len(runs) == ROUNDS
    assert len(pools) == ROUNDS
    assert pools[0] is not pools[1]


@pytest.mark.postgres
async def test_a_pool_the_app_owns_outlives_the_app(postgres_dsn: str, postgres_table: str) -> None:
    """The middleware never closes a pool passed in: what opened it closes it."""
    async with asyncpg.create_pool(postgres_dsn, min_size=1) as pool:
        store = PostgresStore(pool, table=postgres_table)
        await store.create_schema()
        app, _ = guarded_app(store)
        assert (await run_lifespan(app)).messages == [
            "lifespan.startup.complete",
            "lifespan.shutdown.complete",
        ]
        assert not pool.is_closing()
        assert await store.get("nothing") is None


@pytest.mark.postgres
def test_a_store_never_handed_a_pool_refuses_the_startup(postgres_table: str) -> None:
    app, _ = guarded_app(PostgresStore(table=postgres_table))  # the lifespan forgot use_pool
    with (
        pytest.raises(ConfigurationError, match=r"has no pool: .*store\.use_pool\(pool\)"),
        TestClient(app),
    ):
        pass


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = unique_prefix()
    yield prefix
    asyncio.run(delete_prefixed_at(redis_url, prefix))


@pytest.mark.redis
@pytest.mark.parametrize("driver", ["redis-py", "glide"])
def test_redis_from_url_closes_when_the_app_stops(
    redis_url: str, redis_prefix: str, name: str, driver: DriverName
) -> None:
    store = RedisStore.from_url(redis_url, key_prefix=redis_prefix, driver=driver, client_name=name)
    app, runs = guarded_app(store)
    for round_ in range(ROUNDS):
        with TestClient(app) as client:
            assert redis_connections(redis_url, name) >= 1  # the startup check connected
            pay_twice(client, f"key-{round_}")
        eventually_sync(
            lambda: redis_connections(redis_url, name) == 0,
            timeout=5,
            message=f"the {driver} connections named {name} to close",
        )
    assert len(runs) == ROUNDS


@pytest.mark.redis
async def test_a_redis_client_the_app_passed_in_stays_open(
    redis_url: str, redis_prefix: str, name: str
) -> None:
    client = aioredis.from_url(redis_url, client_name=name)
    try:
        app, _ = guarded_app(RedisStore(client, key_prefix=redis_prefix))
        assert (await run_lifespan(app)).messages == [
            "lifespan.startup.complete",
            "lifespan.shutdown.complete",
        ]
        assert await asyncio.to_thread(redis_connections, redis_url, name) >= 1
    finally:
        await client.aclose()


@pytest.mark.postgres
async def test_the_plugins_postgres_store_outlives_an_app_the_test_stops(
    postgres_store: PostgresStore,
) -> None:
    """A test reads the records after stopping its app: the fixture's store is its own."""
    app, _ = guarded_app(FaultyStore(postgres_store))
    assert (await run_lifespan(app)).messages[-1] == "lifespan.shutdown.complete"
    app, _ = guarded_app(postgres_store)
    assert (await run_lifespan(app)).messages[-1] == "lifespan.shutdown.complete"
    assert await postgres_store.get("k") is None


@pytest.mark.redis
async def test_a_faulty_store_is_never_closed_by_the_app(redis_url: str, redis_prefix: str) -> None:
    """The wrapped store is the test's: wrapping one that owns its client changes nothing."""
    inner = RedisStore.from_url(redis_url, key_prefix=redis_prefix)
    try:
        wrapped = FaultyStore(inner)
        app, _ = guarded_app(wrapped)
        await run_lifespan(app)
        assert wrapped.calls["aclose"] == 0
    finally:
        await inner.aclose()


@pytest.mark.postgres
async def test_without_a_lifespan_a_store_never_handed_a_pool_answers_503(
    postgres_table: str, caplog: pytest.LogCaptureFixture
) -> None:
    app, runs = guarded_app(PostgresStore(table=postgres_table))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        response = await client.post("/pay", headers={"Idempotency-Key": "k"})
    assert response.status_code == 503
    assert runs == []
    assert any("has no pool: hand it the pool" in r.getMessage() for r in caplog.records)


def requests_without_a_lifespan(app: FastAPI) -> None:
    """FastAPI's testing pattern: ``TestClient(app)`` without ``with``, so no lifespan runs
    and each request has an event loop of its own; new keys, then a retry replayed."""
    client = TestClient(app)
    for key in ("a", "b", "c"):
        assert client.post("/pay", headers={"Idempotency-Key": key}).status_code == 200
    pay_twice(client, "d")


@pytest.mark.postgres
def test_from_dsn_under_a_test_client_without_its_lifespan(
    postgres_dsn: str, postgres_table: str, name: str
) -> None:
    """Each request's loop closes the pool it opened as it ends; the next opens its own."""
    store = PostgresStore.from_dsn(
        postgres_dsn, table=postgres_table, server_settings={"application_name": name}
    )

    async def migrate() -> None:
        async with store:
            await store.create_schema()

    asyncio.run(migrate())
    app, runs = guarded_app(store)
    requests_without_a_lifespan(app)
    assert runs == [1, 1, 1, 1]
    assert postgres_connections(postgres_dsn, name) == 0


@pytest.mark.redis
@pytest.mark.parametrize("driver", ["redis-py", "glide"])
def test_redis_from_url_under_a_test_client_without_its_lifespan(
    redis_url: str, redis_prefix: str, name: str, driver: DriverName
) -> None:
    """Each request's loop closes the connections it opened as it ends; the next connects."""
    store = RedisStore.from_url(redis_url, key_prefix=redis_prefix, driver=driver, client_name=name)
    app, runs = guarded_app(store)
    requests_without_a_lifespan(app)
    assert runs == [1, 1, 1, 1]
    eventually_sync(
        lambda: redis_connections(redis_url, name) == 0,
        timeout=5,
        message=f"the {driver} connections named {name} to close",
    )


@pytest.mark.redis
def test_redis_from_url_refuses_a_second_live_event_loop(redis_url: str, redis_prefix: str) -> None:
    """Its connections serve the loop that opened them: another is refused, not failed inside
    the driver, until that loop closes them."""
    store = RedisStore.from_url(redis_url, key_prefix=redis_prefix)
    first = asyncio.new_event_loop()
    try:
        assert first.run_until_complete(store.get("k")) is None
        with pytest.raises(ConfigurationError, match="another event loop, which is not closed"):
            asyncio.run(store.get("k"))
        first.run_until_complete(store.aclose())
    finally:
        first.close()
    assert asyncio.run(store.get("k")) is None
