"""PostgresStore.describe() and check() against real servers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores._postgres_check import COLUMNS
from starlette_idempotency.stores._postgres_connections import location_of
from starlette_idempotency.stores.base import CheckableStore, StoreFinding
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._postgres_server import PostgresServer
from tests.support.postgres import a_role
from tests.support.records import pending

pytestmark = pytest.mark.postgres

DURABLE = {"synchronous_commit": "on"}


def levels(findings: list[StoreFinding]) -> list[str]:
    return [finding.level for finding in findings]


async def errors(store: PostgresStore) -> list[StoreFinding]:
    """What ``store.check()`` finds at the error level."""
    return [finding for finding in await store.check() if finding.level == "error"]


async def altered(store: PostgresStore, sql: Any, table: str, change: str) -> None:
    """Create ``store``'s table, then ``ALTER TABLE table change``."""
    await store.create_schema()
    await sql.execute(f"ALTER TABLE {table} {change}")


@pytest.fixture
async def fsync_off(sql: Any) -> bool:
    """Whether the test server runs with fsync off (the throwaway ones do)."""
    return bool(await sql.fetchval("SHOW fsync") == "off")


async def open_store(dsn: str, table: str, **settings: str) -> PostgresStore:
    return await PostgresStore.connect(dsn, table=table, server_settings=settings, max_size=1)


@pytest.fixture
async def durable_store(postgres_dsn: str, postgres_table: str) -> AsyncIterator[PostgresStore]:
    store = await open_store(postgres_dsn, postgres_table, **DURABLE)
    try:
        yield store
    finally:
        await store.aclose()


def test_location_of_a_dsn_never_shows_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PGHOST", "PGPORT", "PGDATABASE", "PGUSER"):
        monkeypatch.delenv(variable, raising=False)
    assert location_of("postgresql://app:s3cret@db.internal:6543/payments", {}) == (
        "db.internal:6543/payments"
    )
    assert location_of("postgresql://app:s3cret@db.internal/payments?sslmode=require", {}) == (
        "db.internal:5432/payments"
    )
    assert (
        location_of("postgresql://app@h1:5432,h2:5433/payments", {}) == "h1:5432,h2:5433/payments"
    )
    assert location_of("postgresql:///payments?host=/run/postgresql", {}) == (
        "/run/postgresql:5432/payments"
    )
    assert location_of("postgresql://app@db", {"port": 7000}) == "db:7000/app"  # db = user
    assert location_of("postgresql://db/payments", {"database": "other"}) == "db:5432/other"
    assert location_of("postgresql://app:s3cret@[::1]:6543/payments", {}) == "[::1]:6543/payments"
    for not_a_url in (
        "postgresql//app:s3cret@db.internal/payments",  # a colon missing
        "app:s3cret@db.internal/payments",
        "host=db.internal password=s3cret dbname=payments",
        # A password with an unescaped /, ? or # ends urlsplit's address early.
        "postgresql://app:s3/cret@db.internal:6543/payments",
        "postgresql://app:s3?cret@db.internal/payments",
        "postgresql://app:s3#cret@db.internal/payments",
        "postgresql://app:12/34@db.internal/payments",
        "postgresql://app:[s3cret]@db.internal/payments",  # urlsplit raises: not IPv6
        "postgresql://app:s3cret]@db.internal/payments",
    ):
        assert location_of(not_a_url, {}) == "(a DSN that is not a postgresql:// URL)"
    monkeypatch.setenv("PGHOST", "from-env")
    monkeypatch.setenv("PGDATABASE", "envdb")
    assert location_of("postgresql://", {}) == "from-env:5432/envdb"


async def test_describe_names_server_database_and_table_without_password(
    postgres_dsn: str, postgres_table: str
) -> None:
    parts = urlsplit(postgres_dsn)
    if "://" not in postgres_dsn or parts.hostname is None:
        pytest.skip("needs a postgresql:// DSN")
    host, port = parts.hostname, parts.port or 5432
    user = parts.username or "postgres"
    with_password = urlunsplit(parts._replace(netloc=f"{user}:s3cret@{host}:{port}"))
    expected = f"postgres at {host}:{port}{parts.path} table {postgres_table}"

    store = await PostgresStore.connect(with_password, table=postgres_table, max_size=1)
    try:
        assert isinstance(store, CheckableStore)
        assert store.describe() == expected
        assert "s3cret" not in store.describe()
    finally:
        await store.aclose()

    pool = await asyncpg.create_pool(with_password, min_size=0, max_size=1)
    try:
        assert PostgresStore(pool, table=postgres_table).describe() == expected
    finally:
        await pool.close()
    unknown = PostgresStore(object(), table="t")  # type: ignore[arg-type]
    assert unknown.describe() == "postgres at an unknown address (a pool passed in) table t"


async def test_check_knows_every_column_of_the_schema(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await durable_store.create_schema()
    columns = await sql.fetchval(
        "SELECT array_agg(column_name::text) FROM information_schema.columns WHERE table_name = $1",
        postgres_table,
    )
    assert sorted(columns) == sorted(COLUMNS)


async def test_a_ready_store_has_no_error(durable_store: PostgresStore, fsync_off: bool) -> None:
    await durable_store.create_schema()
    findings = await durable_store.check()
    assert levels(findings) == (["warning"] if fsync_off else [])
    if fsync_off:
        assert "fsync is off" in findings[0].message


async def test_missing_table_is_an_error_that_says_how_to_create_it(
    durable_store: PostgresStore, postgres_table: str
) -> None:
    [error] = await errors(durable_store)
    assert f"table {postgres_table} in " in error.message
    assert "does not exist" in error.message
    assert "starlette-idempotency migrate" in error.message
    assert "create_schema()" in error.message

    await durable_store.create_schema()
    assert "error" not in levels(await durable_store.check())


async def test_a_table_from_an_older_version_is_an_error_until_migrated(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await altered(durable_store, sql, postgres_table, "DROP COLUMN checkpoints")
    [error] = await errors(durable_store)
    assert "lacks column(s) checkpoints" in error.message
    assert "starlette-idempotency migrate" in error.message

    await durable_store.create_schema()  # what migrate runs
    assert "error" not in levels(await durable_store.check())


async def test_a_schema_made_before_the_claims_is_a_warning_until_migrated(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await durable_store.create_schema()
    await sql.execute(f'DROP TABLE "{postgres_table}_operations"')
    [missing] = [f for f in await durable_store.check() if "operation claims" in f.message]
    assert missing.level == "warning"
    assert missing.message.startswith(f"table {postgres_table}_operations in ")
    assert "apps make no claims" in missing.message
    assert "starlette-idempotency migrate" in missing.message

    await durable_store.create_schema()  # what migrate runs
    assert not [f for f in await durable_store.check() if "operation claims" in f.message]


async def test_an_unlogged_table_is_a_warning(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await altered(durable_store, sql, postgres_table, "SET UNLOGGED")
    [unlogged] = [f for f in await durable_store.check() if "UNLOGGED" in f.message]
    assert unlogged.level == "warning"


async def test_synchronous_commit_off_is_a_warning(
    postgres_dsn: str, postgres_table: str, fsync_off: bool
) -> None:
    store = await open_store(postgres_dsn, postgres_table, synchronous_commit="off")
    try:
        await store.create_schema()
        findings = await store.check()
    finally:
        await store.aclose()
    assert levels(findings) == ["warning"] * (2 if fsync_off else 1)
    assert "synchronous_commit is off" in findings[0].message


async def test_a_read_only_server_is_an_error(postgres_dsn: str, postgres_table: str) -> None:
    writable = await open_store(postgres_dsn, postgres_table)
    try:
        await writable.create_schema()
    finally:
        await writable.aclose()
    store = await open_store(postgres_dsn, postgres_table, default_transaction_read_only="on")
    try:
        [error] = await errors(store)
    finally:
        await store.aclose()
    assert "read-only (transaction_read_only is on)" in error.message


async def test_unreachable_server_is_one_error_never_an_exception(
    private_postgres: PostgresServer,
) -> None:
    store = await PostgresStore.connect(private_postgres.dsn, operation_timeout=5, max_size=1)
    try:
        await store.create_schema()
        findings = await store.check()  # a throwaway server: nothing is durable
        assert levels(findings) == ["warning", "warning"]
        assert "synchronous_commit is off" in findings[0].message
        assert "fsync is off" in findings[1].message

        private_postgres.stop()
        [finding] = await store.check()
        assert finding.level == "error"
        assert finding.message.startswith(f"{store.describe()} is unreachable: ")
    finally:
        await store.aclose()


def a_reader(dsn: str, table: str, sql: Any) -> contextlib.AbstractAsyncContextManager[str]:
    """The DSN of a role that may only read ``table`` (and its claims), for the block."""
    return a_role(
        sql, dsn, f"{table}_reader", f"SELECT ON {table}", f"SELECT ON {table}_operations"
    )


async def test_a_role_that_cannot_write_the_table_is_an_error(
    durable_store: PostgresStore, postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    """Reaching the table is not enough: a role that may only read it fails every request."""
    await durable_store.create_schema()
    async with a_reader(postgres_dsn, postgres_table, sql) as as_reader:
        reader = await open_store(as_reader, postgres_table, **DURABLE)
        try:
            [error] = await errors(reader)
        finally:
            await reader.aclose()
    assert "refuses what every request does" in error.message
    assert "permission denied" in error.message
    assert (
        f"Grant the store's role SELECT, INSERT, UPDATE and DELETE on {postgres_table} and "
        f"{postgres_table}_operations, " in error.message
    )


async def test_a_role_without_rights_on_the_claims_is_a_warning_naming_the_grant(
    durable_store: PostgresStore, postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    """Such a role serves requests, but its app makes no claims (it logs that it could not):
    a warning, which says what to grant."""
    await durable_store.create_schema()
    role = f"{postgres_table}_app"
    async with a_role(
        sql,
        postgres_dsn,
        role,
        f"SELECT, INSERT, UPDATE, DELETE ON {postgres_table}",
        f"SELECT ON {postgres_table}_operations",
    ) as as_app:
        store = await open_store(as_app, postgres_table, **DURABLE)
        try:
            findings = await store.check()
        finally:
            await store.aclose()
    assert "error" not in levels(findings)
    [refused] = [f for f in findings if "operation claims" in f.message]
    assert refused.level == "warning"
    assert refused.message.startswith(
        f"role {role} lacks INSERT, UPDATE, DELETE on table {postgres_table}_operations in "
    )
    assert "apps make no claims" in refused.message
    assert refused.message.endswith(
        f'run GRANT INSERT, UPDATE, DELETE ON "{postgres_table}_operations" TO {role}'
    )


async def test_a_pool_handed_over_later_is_checked_again(
    durable_store: PostgresStore, postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    """The round trip that once worked is not tried again, but on the pool it worked on: a
    new lifespan's pool may log in as another role (a reader, here)."""
    await durable_store.create_schema()
    store = PostgresStore(table=postgres_table)
    settings = {"server_settings": DURABLE, "min_size": 1, "max_size": 1}
    async with asyncpg.create_pool(postgres_dsn, **settings) as writer:
        store.use_pool(writer)
        assert await errors(store) == []
    async with (
        a_reader(postgres_dsn, postgres_table, sql) as as_reader,
        asyncpg.create_pool(as_reader, **settings) as reader,
    ):
        store.use_pool(reader)
        [error] = await errors(store)
    assert "permission denied" in error.message


async def test_a_table_without_its_primary_key_is_an_error(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await durable_store.create_schema()
    constraint = await sql.fetchval(
        "SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
        postgres_table,
    )
    await sql.execute(f"ALTER TABLE {postgres_table} DROP CONSTRAINT {constraint}")
    [error] = await errors(durable_store)
    assert "ON CONFLICT" in error.message
    assert "migrate --sql" in error.message


async def test_a_table_that_fails_requests_later_is_checked_again(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    """The round trip worked at startup; then a migration dropped the primary key. Every
    request fails, and the next probe finds why rather than answering ready."""
    await durable_store.create_schema()
    assert await errors(durable_store) == []
    constraint = await sql.fetchval(
        "SELECT conname FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
        postgres_table,
    )
    await sql.execute(f"ALTER TABLE {postgres_table} DROP CONSTRAINT {constraint}")
    assert await errors(durable_store) == []  # no probe tries it while the store works
    with pytest.raises(StoreError):
        await durable_store.try_acquire("k", pending("k"), 30)
    [error] = await errors(durable_store)
    assert "ON CONFLICT" in error.message


async def test_the_check_leaves_no_row_behind(
    durable_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    await durable_store.create_schema()
    await durable_store.check()
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 0
