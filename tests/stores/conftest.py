"""Fixtures of the store tests: ``store`` (every backend behind one contract, see
:mod:`tests.support.stores`), and raw clients to arrange and inspect what a server holds."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import pytest
import redis.asyncio as aioredis

from starlette_idempotency.stores import IdempotencyRecord
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.cutting_proxy import CuttingProxy
from tests.support.records import pending
from tests.support.stores import STORE_FACTORIES, ClockedStore, Factory


@pytest.fixture(params=STORE_FACTORIES)
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[ClockedStore]:
    factory: Factory = request.param
    async with factory(request) as built:
        yield built


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
