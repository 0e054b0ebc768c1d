"""pytest fixtures for a Redis and a PostgreSQL, and a ready store on each.

Opt in from your root ``conftest.py`` (it is never loaded on its own)::

    pytest_plugins = ["starlette_idempotency.testing.pytest_plugin"]

Each server comes from ``REDIS_URL`` / ``DATABASE_URL`` when set, else from testcontainers when
it is installed and a Docker engine answers, else from a throwaway local server (see
:mod:`.services`); it is started once per test run. Tests share it without touching anything
else on it (see :mod:`.isolation`): a Redis key prefix per test, whose keys are deleted after
the test, and a PostgreSQL database per run, dropped at its end, with a table per test.

The Redis fixtures need the ``redis`` extra and the PostgreSQL ones the ``postgres`` extra (a
test that asks for one without it fails, naming the extra); a test that uses neither needs
neither. The async fixtures are pytest-asyncio's, so they work in
its strict mode as in its auto mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

from starlette_idempotency.testing import _isolation as isolation
from starlette_idempotency.testing._services import (
    DATABASE_ENV,
    POSTGRES_CONTAINERS,
    REDIS_CONTAINERS,
    REDIS_ENV,
    choose_source,
    machine_probes,
    module_installed,
    postgres_service,
    redis_service,
)

if TYPE_CHECKING:
    from starlette_idempotency.stores.postgres import PostgresStore
    from starlette_idempotency.stores.redis import RedisStore


def _require_extra(module: str, extra: str) -> None:
    """Fail the test, naming the extra to install, when ``module`` cannot be imported."""
    if not module_installed(module):
        pytest.fail(
            f"the {extra} fixtures of starlette_idempotency.testing need {module}: "
            f"pip install 'starlette-idempotency[{extra}]'",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the Redis the tests share; never flush it or stop it."""
    with redis_service(choose_source(REDIS_ENV, machine_probes(REDIS_CONTAINERS))) as url:
        yield url


@pytest_asyncio.fixture
async def redis_key_prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of the test's own on the shared Redis; its keys are deleted after it."""
    _require_extra("redis", "redis")
    prefix = isolation.unique_prefix()
    yield prefix
    await isolation.delete_prefixed_at(redis_url, prefix)


@pytest_asyncio.fixture
async def redis_store(redis_url: str, redis_key_prefix: str) -> AsyncIterator[RedisStore]:
    """A :class:`~starlette_idempotency.RedisStore` under the test's key prefix, closed after."""
    from starlette_idempotency.stores.redis import RedisStore

    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture(scope="session")
def postgres_admin_dsn() -> Iterator[str]:
    """A DSN of the PostgreSQL the tests share, as a user allowed to create databases."""
    choice = choose_source(DATABASE_ENV, machine_probes(POSTGRES_CONTAINERS))
    with postgres_service(choice) as dsn:
        yield dsn


@pytest.fixture(scope="session")
def postgres_dsn(postgres_admin_dsn: str) -> Iterator[str]:
    """A DSN of a database that exists for this test run only."""
    _require_extra("asyncpg", "postgres")
    with isolation.run_database(postgres_admin_dsn) as dsn:
        yield dsn


@pytest.fixture
def postgres_table(postgres_dsn: str) -> Iterator[str]:
    """A table name of the test's own, in :func:`postgres_dsn`'s database. The table, if the
    test created it, is dropped after the test, so that a ``postgres_dsn`` of your own (a
    database the run does not drop) keeps none."""
    table = isolation.unique_table()
    yield table
    isolation.drop_table(postgres_dsn, table)


@pytest_asyncio.fixture
async def postgres_store(postgres_dsn: str, postgres_table: str) -> AsyncIterator[PostgresStore]:
    """A :class:`~starlette_idempotency.PostgresStore` on the test's own table (schema
    created), on a pool of the fixture's that it closes after the test: an app the test
    starts and stops leaves it open, for the test to read the records after."""
    import asyncpg  # type: ignore[import-untyped]

    from starlette_idempotency.stores.postgres import PostgresStore

    async with asyncpg.create_pool(postgres_dsn, min_size=1) as pool:
        store = PostgresStore(pool, table=postgres_table)
        try:
            await store.create_schema()
            yield store
        finally:
            await store.aclose()
