"""PostgresStore built before any event loop runs: ``from_dsn`` opens its pool on first use, in
the running loop, once; ``aclose`` closes it for that loop; ``use_pool`` takes the app's pool.

Connections are counted in ``pg_stat_activity`` by an ``application_name`` of the test's own.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency.errors import ConfigurationError, StoreError
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._isolation import run_admin
from tests.support.postgres import wait_for_no_backends
from tests.support.records import pending

pytestmark = pytest.mark.postgres

ROUNDS = 20
CALLERS = 20


@pytest.fixture
def app_name() -> str:
    return f"lazy-{uuid.uuid4().hex[:12]}"


def backends(dsn: str, name: str) -> int:
    count: int = run_admin(
        dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
    )
    return count


def lazy_store(dsn: str, table: str, name: str, **options: Any) -> PostgresStore:
    return PostgresStore.from_dsn(
        dsn, table=table, server_settings={"application_name": name}, **options
    )


@pytest.fixture
def schema(postgres_dsn: str, postgres_table: str) -> None:
    """The test's table, created from a loop of its own (so that tests can run theirs)."""

    async def create() -> None:
        async with PostgresStore.from_dsn(postgres_dsn, table=postgres_table) as store:
            await store.create_schema()

    asyncio.run(create())


def test_from_dsn_connects_nothing_until_used(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name)  # no event loop runs here
    assert backends(postgres_dsn, app_name) == 0

    async def use() -> None:
        assert await store.get("nothing") is None
        assert backends(postgres_dsn, app_name) == 1  # min_size=1, in this loop
        await store.aclose()

    asyncio.run(use())
    assert backends(postgres_dsn, app_name) == 0


async def test_concurrent_first_calls_open_one_pool(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    for _ in range(ROUNDS):
        store = lazy_store(postgres_dsn, postgres_table, app_name, min_size=2, max_size=2)
        found = await asyncio.gather(*(store.get(f"k{i}") for i in range(CALLERS)))
        assert found == [None] * CALLERS
        assert backends(postgres_dsn, app_name) == 2  # one pool of two, not one per caller
        await store.aclose()
        assert backends(postgres_dsn, app_name) == 0


async def test_a_first_caller_cut_short_leaves_the_opening_to_the_others(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name, min_size=2, max_size=2)
    first = asyncio.ensure_future(store.get("first"))
    await asyncio.sleep(0)  # the first call has started the opening
    first.cancel()
    assert await store.get("second") is None
    assert first.cancelled()
    assert backends(postgres_dsn, app_name) == 2
    await store.aclose()


async def test_a_closed_store_opens_nothing_more_in_its_loop(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    await store.get("k")
    await store.aclose()
    with pytest.raises(StoreError, match="is closed"):
        await store.get("k")
    with pytest.raises(StoreError, match="is closed"):
        await store.try_acquire("k", pending("k", "owner"), 30)
    await store.aclose()  # twice is fine
    assert backends(postgres_dsn, app_name) == 0


async def test_reopen_lets_a_closed_store_open_a_pool_again_in_its_loop(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    """What the middleware does when the app starts again in the same event loop."""
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    for _ in range(2):
        store.reopen()
        assert await store.get("k") is None
        assert backends(postgres_dsn, app_name) == 1
        await store.aclose()
        assert backends(postgres_dsn, app_name) == 0


async def test_a_store_closed_before_its_first_use_stays_closed(
    postgres_dsn: str, postgres_table: str, app_name: str
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    await store.aclose()
    with pytest.raises(StoreError, match="is closed"):
        await store.get("k")
    assert backends(postgres_dsn, app_name) == 0


async def test_closing_during_the_opening_leaves_no_pool(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    for _ in range(ROUNDS):
        store = lazy_store(postgres_dsn, postgres_table, app_name, min_size=2, max_size=2)
        waiting = asyncio.gather(*(store.get("k") for _ in range(3)), return_exceptions=True)
        await asyncio.sleep(0)  # the opening has started
        await store.aclose()
        for outcome in await waiting:  # each caller got an answer or the reason, never hung
            assert outcome is None or isinstance(outcome, StoreError), outcome
        wait_for_no_backends(postgres_dsn, app_name)


def test_each_new_event_loop_opens_its_own_after_the_last_one_closed(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    """What a test client that starts the app twice does: two loops, one after the other."""
    store = lazy_store(postgres_dsn, postgres_table, app_name)

    async def run_once(key: str) -> None:
        assert await store.try_acquire(key, pending(key, "owner"), 30)
        await store.aclose()

    asyncio.run(run_once("first"))
    asyncio.run(run_once("second"))
    assert backends(postgres_dsn, app_name) == 0


def test_a_loop_that_ends_with_its_pool_open_closes_it(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    """No aclose, as a request without a lifespan leaves it: the loop's end closes the pool
    (asyncio.run shuts its async generators down), and the next loop opens its own."""
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    for _ in range(ROUNDS):
        asyncio.run(store.get("k"))
        assert backends(postgres_dsn, app_name) == 0


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_a_loop_closed_with_its_pool_open_is_named(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(store.get("k"))
    loop.close()  # without shutdown_asyncgens(): nothing closed the pool in its loop
    with pytest.raises(ConfigurationError, match="ended without closing it") as refused:
        asyncio.run(store.get("k"))
    assert "lifespan" in str(refused.value)
    # Nothing can close a pool whose event loop has ended: its sockets go when it is collected
    # (here, with the warning asyncpg gives), which is why a new loop is refused rather than
    # handed a second pool.
    del store, refused
    gc.collect()
    wait_for_no_backends(postgres_dsn, app_name)


def test_a_second_loop_is_refused_while_the_first_is_open(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = lazy_store(postgres_dsn, postgres_table, app_name)
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(store.get("k"))
        with pytest.raises(ConfigurationError, match="another event loop, which is not closed"):
            asyncio.run(store.get("k"))
        first.run_until_complete(store.aclose())
    finally:
        first.close()
    asyncio.run(store.aclose())  # the first loop is closed: this one takes the store over
    assert backends(postgres_dsn, app_name) == 0


async def test_connect_opens_at_once_on_the_same_code(
    postgres_dsn: str, postgres_table: str, app_name: str
) -> None:
    store = await PostgresStore.connect(
        postgres_dsn, table=postgres_table, server_settings={"application_name": app_name}
    )
    assert store.owns_connections
    assert backends(postgres_dsn, app_name) == 1
    await store.aclose()
    assert backends(postgres_dsn, app_name) == 0


async def test_pool_options_asyncpg_refuses_are_a_configuration_error(
    postgres_dsn: str, postgres_table: str
) -> None:
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table, min_size=5, max_size=2)
    with pytest.raises(ConfigurationError, match="PostgresStore pool options: min_size"):
        await store.get("k")
    with pytest.raises(ConfigurationError, match="pool options"):
        await store.check()  # the startup check raises it, refusing the startup
    await store.aclose()


async def test_an_unreachable_database_is_a_store_error_and_tried_again(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    """A first request while the database is away fails; a later one opens the pool."""
    store = lazy_store("postgresql://postgres@127.0.0.1:1/nowhere", postgres_table, app_name)
    with pytest.raises(StoreError, match="PostgreSQL connect failed"):
        await store.get("k")
    (finding,) = await store.check()
    assert finding.level == "error"
    assert "is unreachable" in finding.message
    await store.aclose()


# --- a pool the app opened: use_pool -------------------------------------------------------


async def test_an_operation_before_any_pool_says_what_to_do(postgres_table: str) -> None:
    store = PostgresStore(table=postgres_table)
    assert not store.owns_connections
    assert store.describe() == f"postgres (no pool handed over yet) table {postgres_table}"
    with pytest.raises(ConfigurationError, match=r"has no pool: .*store\.use_pool\(pool\)"):
        await store.get("k")
    with pytest.raises(ConfigurationError, match="has no pool"):
        await store.check()


async def test_use_pool_takes_the_apps_pool_and_leaves_it_open(
    postgres_dsn: str, postgres_table: str, app_name: str, schema: None
) -> None:
    store = PostgresStore(table=postgres_table)
    async with asyncpg.create_pool(
        postgres_dsn, min_size=1, server_settings={"application_name": app_name}
    ) as pool:
        store.use_pool(pool)
        assert store.describe().startswith("postgres at ")
        assert await store.try_acquire("k", pending("k", "owner"), 30)
        await store.aclose()
        assert not pool.is_closing()
        assert (await store.get("k")) is not None  # still usable with the app's pool
        store.use_pool(pool)  # the same pool again changes nothing
        async with asyncpg.create_pool(postgres_dsn, min_size=0) as another:
            with pytest.raises(ConfigurationError, match="already uses a pool, which is still"):
                store.use_pool(another)
    async with asyncpg.create_pool(postgres_dsn, min_size=0) as second:
        store.use_pool(second)  # the first is closed: a new lifespan hands over its own
        assert (await store.get("k")) is not None


async def test_use_pool_is_refused_on_a_store_with_a_pool_of_its_own(
    postgres_dsn: str, postgres_table: str
) -> None:
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table)
    async with asyncpg.create_pool(postgres_dsn, min_size=0) as pool:
        with pytest.raises(ConfigurationError, match=r"opens a pool of its own .*PostgresStore\("):
            store.use_pool(pool)
    await store.aclose()


async def test_without_a_dsn_the_libpq_environment_says_where(
    postgres_dsn: str, postgres_table: str, monkeypatch: pytest.MonkeyPatch, schema: None
) -> None:
    parts = urlsplit(postgres_dsn)
    for variable, value in {
        "PGHOST": parts.hostname,
        "PGPORT": str(parts.port or 5432),
        "PGUSER": parts.username,
        "PGDATABASE": parts.path.strip("/"),
    }.items():
        monkeypatch.setenv(variable, value or "")
    store = PostgresStore.from_dsn(None, table=postgres_table)
    assert store.describe() == (
        f"postgres at {parts.hostname}:{parts.port or 5432}/{parts.path.strip('/')} "
        f"table {postgres_table}"
    )
    assert await store.get("k") is None
    await store.aclose()
