"""Fixtures of the store tests: ``store`` (every backend behind one contract, see
:mod:`tests.support.stores`), and raw clients to arrange and inspect what a server holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
import redis.asyncio as aioredis

from starlette_idempotency import PostgresStore
from starlette_idempotency.stores import IdempotencyRecord
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.testing._isolation import (
    delete_prefixed_at,
    unique_prefix,
    unique_table,
)
from starlette_idempotency.testing._redis_server import RedisServer
from tests.stores.transaction_app import create_tables, drop_tables
from tests.support.cutting_proxy import CuttingProxy
from tests.support.pods import Pods
from tests.support.records import pending
from tests.support.stores import STORE_FACTORIES, ClockedStore, Factory
from tests.support.uvicorn import UvicornServer


@pytest.fixture(params=STORE_FACTORIES)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[ClockedStore]:
    factory: Factory = request.param
    async with factory(request) as built:
        yield built


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def pod_urls(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """Two pods (uvicorn processes running :mod:`tests.stores.pod_app`) on one store, RedisStore
    or PostgresStore, started once per store for a test module."""
    env = {"IDEM_TEST_STORE": request.param}
    prefix = unique_prefix()
    if request.param == "redis":
        redis_url = request.getfixturevalue("redis_url")
        env |= {"IDEM_TEST_REDIS_URL": redis_url, "IDEM_TEST_PREFIX": prefix}
    else:
        env |= {
            "IDEM_TEST_DSN": request.getfixturevalue("postgres_dsn"),
            "IDEM_TEST_TABLE": unique_table(),
        }
    app = "tests.stores.pod_app:create_app"
    with ExitStack() as stack:
        holder = stack.enter_context(
            UvicornServer(app, env={**env, "IDEM_TEST_POD": "holder"}, factory=True)
        )
        retrier = stack.enter_context(
            UvicornServer(app, env={**env, "IDEM_TEST_POD": "retrier"}, factory=True)
        )
        yield holder.url, retrier.url
    if request.param == "redis":
        asyncio.run(delete_prefixed_at(redis_url, prefix))


@pytest.fixture
async def pods(pod_urls: tuple[str, str]) -> AsyncIterator[Pods]:
    holder_url, retrier_url = pod_urls
    async with (
        httpx.AsyncClient(base_url=holder_url, timeout=30) as holder,
        httpx.AsyncClient(base_url=retrier_url, timeout=30) as retrier,
    ):
        yield Pods(holder, retrier)
        for client in (holder, retrier):
            await client.post("/_clock", json={"offset": 0})


@pytest.fixture
def store(harness: ClockedStore) -> IdempotencyStore:
    return harness.store


@pytest.fixture
def make_record(harness: ClockedStore) -> Callable[..., IdempotencyRecord]:
    """Build an ``InProgress`` record (``owner_token`` required) on the store's clock."""

    def make(
        key: str, owner_token: str, *, fingerprint: str = "sha256:abc", lock_ttl: float = 30.0
    ) -> IdempotencyRecord:
        return pending(
            key, owner_token, fingerprint=fingerprint, lock_ttl=lock_ttl, now=harness.now()
        )

    return make


@pytest.fixture
async def admin(private_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A raw client on the private Redis, for INFO, CLIENT PAUSE and SCRIPT FLUSH."""
    raw = aioredis.from_url(private_redis.url)
    await raw.ping()
    yield raw
    await raw.aclose()


@pytest.fixture
async def sql(postgres_dsn: str) -> AsyncIterator[Any]:
    """A plain asyncpg connection for arranging and inspecting rows."""
    connection = await asyncpg.connect(postgres_dsn)
    yield connection
    await connection.close()


@pytest.fixture
async def proxy(postgres_dsn: str) -> AsyncIterator[CuttingProxy]:
    """A proxy in front of the test database, to lose an exchange (see
    :mod:`tests.support.cutting_proxy`)."""
    parts = urlsplit(postgres_dsn)
    if "://" not in postgres_dsn or parts.hostname is None or parts.hostname.startswith("/"):
        pytest.skip("the proxy needs a postgresql:// DSN with a TCP host")
    async with CuttingProxy(parts.hostname, parts.port or 5432) as running:
        yield running


@pytest.fixture
async def tables(postgres_dsn: str, postgres_table: str, sql: Any) -> AsyncIterator[str]:
    """The store's table and the payments app's (:mod:`tests.stores.transaction_app`)."""
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table)
    await store.create_schema()
    await store.aclose()
    await create_tables(sql, postgres_table)
    yield postgres_table
    await drop_tables(sql, postgres_table)
