"""PostgresStore against a real PostgreSQL: SQL shape, expiry, fencing, outages, purge."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    _format_time,
    record_to_dict,
)
from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError
from starlette_idempotency.stores._postgres_sql import row_time
from starlette_idempotency.stores.base import AcquireResult, FencedWrite, IdempotencyStore
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._postgres_server import PostgresServer
from starlette_idempotency.testing._processes import free_port
from tests.support import records
from tests.support.conditions import eventually
from tests.support.postgres import (
    LOCK_TTL,
    TTL,
    completed,
    deadline_in,
    expire,
    lapsed_lock,
    pending,
    rows_locked,
)

pytestmark = pytest.mark.postgres


class StatementLog:
    """The statements run on a pool's connections that touch the store's table."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.queries: list[str] = []

    def __call__(self, record: Any) -> None:
        if self.table in record.query:
            self.queries.append(" ".join(record.query.split()))

    async def take(self) -> list[str]:
        await asyncio.sleep(0)  # loggers are called with loop.call_soon
        queries, self.queries = self.queries, []
        return queries


@pytest.fixture
async def logged(
    postgres_dsn: str, postgres_table: str
) -> AsyncIterator[tuple[PostgresStore, StatementLog]]:
    log = StatementLog(postgres_table)

    async def init(connection: Any) -> None:
        connection.add_query_logger(log)

    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=2, init=init)
    store = PostgresStore(pool, table=postgres_table)
    await store.create_schema()
    await log.take()
    yield store, log
    await store.aclose()
    await pool.close()


def first_words(queries: list[str]) -> list[str]:
    return [query.split()[0] for query in queries]


async def test_is_an_idempotency_store(postgres_store: PostgresStore) -> None:
    assert isinstance(postgres_store, IdempotencyStore)
    assert postgres_store.name == "postgres"


async def test_acquire_is_insert_first_and_writes_are_single_statements(
    logged: tuple[PostgresStore, StatementLog], postgres_table: str, sql: Any
) -> None:
    store, log = logged
    first = pending("owner-1")

    assert (await store.try_acquire("k", first, LOCK_TTL)).acquired
    assert first_words(await log.take()) == ["INSERT"]  # free key: one INSERT, no read first

    held = await store.try_acquire("k", pending("owner-2"), LOCK_TTL)
    assert not held.acquired
    assert held.record is not None
    assert held.record.owner_token == "owner-1"
    assert first_words(await log.take()) == ["INSERT", "WITH"]  # conflict: INSERT + read

    assert await store.renew("k", "owner-1", LOCK_TTL)
    assert first_words(await log.take()) == ["UPDATE"]
    assert await store.finish("k", completed(first), TTL) is FencedWrite.WRITTEN
    assert first_words(await log.take()) == ["WITH"]  # lock the row, upsert fenced by owner
    assert await store.get("k") is not None
    assert first_words(await log.take()) == ["SELECT"]
    assert await store.release("k", "owner-1")
    assert first_words(await log.take()) == ["WITH"]  # fenced DELETE

    await lapsed_lock(store, sql, postgres_table, "k", first)
    await log.take()
    taken = await store.try_acquire("k", pending("owner-3"), LOCK_TTL)
    assert taken.acquired
    assert first_words(await log.take()) == ["INSERT", "WITH"]  # takeover: INSERT + UPDATE


async def test_live_key_is_not_acquired_and_record_is_returned(
    postgres_store: PostgresStore,
) -> None:
    first = pending("owner-1")
    result = await postgres_store.try_acquire("k", first, LOCK_TTL)
    assert result == AcquireResult(acquired=True, record=None)

    again = await postgres_store.try_acquire("k", pending("owner-2", fingerprint="other"), 5)
    assert not again.acquired
    assert again.record is not None
    assert again.record.owner_token == "owner-1"
    assert again.record.request_fingerprint == "sha256:aa"
    assert again.record.status is RecordStatus.IN_PROGRESS
    assert again.record.expires_at == pytest.approx(time.time() + LOCK_TTL, abs=5)


async def test_expired_row_is_taken_over_and_old_owner_is_fenced(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    old = pending("owner-old")
    await lapsed_lock(postgres_store, sql, postgres_table, "k", old)

    taken = await postgres_store.try_acquire("k", pending("owner-new"), LOCK_TTL)
    assert taken.acquired
    assert taken.record is not None
    assert record_to_dict(taken.record) == record_to_dict(old)  # the expired record it replaced

    # The old owner's late writes neither overwrite nor delete its successor's lock.
    assert await postgres_store.finish("k", completed(old), TTL) is FencedWrite.LOST
    assert await postgres_store.finish("k", completed(old), TTL) is FencedWrite.LOST
    assert not await postgres_store.renew("k", "owner-old", LOCK_TTL)
    assert not await postgres_store.release("k", "owner-old")
    current = await postgres_store.get("k")
    assert current is not None
    assert current.owner_token == "owner-new"
    assert current.status is RecordStatus.IN_PROGRESS


async def test_expired_rows_are_invisible_before_purge(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    record = pending("owner-1")
    await postgres_store.try_acquire("k", record, LOCK_TTL)
    await postgres_store.finish("k", completed(record), TTL)
    await expire(sql, postgres_table, "k")

    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 1
    assert await postgres_store.get("k") is None
    assert not await postgres_store.renew("k", "owner-1", LOCK_TTL)
    assert await postgres_store.release("k", "someone-else")  # nobody holds the key
    assert (await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired


async def test_short_real_lock_ttl_expires_on_the_database_clock(
    postgres_store: PostgresStore,
) -> None:
    # created_at from a badly skewed pod clock changes nothing: expiry is now() + lock_ttl.
    skewed = IdempotencyRecord(
        key="k",
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint="fp",
        owner_token="owner-1",
        created_at=time.time() - 86400,
        expires_at=0.0,
    )
    assert (await postgres_store.try_acquire("k", skewed, 0.3)).acquired
    held = await postgres_store.try_acquire("k", pending("owner-2"), 0.3)
    assert not held.acquired
    assert held.record is not None
    assert held.record.expires_at == 0.0  # the record's own times are data, returned as given

    async def expired() -> bool:
        return (await postgres_store.get("k")) is None

    await eventually(expired, timeout=5, interval=0.05, message="the lock to expire")
    assert (await postgres_store.try_acquire("k", pending("owner-2"), 0.3)).acquired


async def test_complete_stores_record_when_row_is_absent_or_expired(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    # Absent: the lock lapsed and was purged, nobody took it over.
    record = pending("owner-1")
    assert await postgres_store.finish("k", completed(record), TTL) is FencedWrite.RECLAIMED
    stored = await postgres_store.get("k")
    assert stored is not None
    assert stored.status is RecordStatus.COMPLETED

    # Expired but still there: same.
    other = pending("owner-2", key="k2")
    await lapsed_lock(postgres_store, sql, postgres_table, "k2", other)
    assert await postgres_store.finish("k2", completed(other), TTL) is FencedWrite.RECLAIMED
    failed = await postgres_store.get("k2")
    assert failed is not None
    assert failed.status is RecordStatus.COMPLETED  # as passed in: the store keeps what it is given
    assert await deadline_in(sql, postgres_table, "k2") == pytest.approx(TTL, abs=5)


async def test_fail_stores_a_replayable_failed_record(postgres_store: PostgresStore) -> None:
    record = pending("owner-1")
    await postgres_store.try_acquire("k", record, LOCK_TTL)
    response = StoredResponse(409, (("content-type", "application/problem+json"),), b"{}", None)
    assert await postgres_store.finish(
        "k", record.finished(RecordStatus.FAILED, response, record.expires_at), TTL
    )
    stored = await postgres_store.get("k")
    assert stored is not None
    assert stored.status is RecordStatus.FAILED
    assert stored.response == response
    # A finished key is held until its retention ends: no acquire, no renew.
    assert not (await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired
    assert not await postgres_store.renew("k", "owner-1", LOCK_TTL)


async def test_response_round_trips_byte_for_byte(postgres_store: PostgresStore) -> None:
    record = pending("owner-1", key="ключ-🔑")
    body = bytes(range(256)) * 64
    headers = (("content-type", "application/octet-stream"), ("x-name", "Zoë 🎉"), ("x-dup", "1"))
    response = StoredResponse(200, (*headers, ("x-dup", "2")), body, None)
    finished = record.finished(RecordStatus.COMPLETED, response, record.expires_at)
    await postgres_store.try_acquire("ключ-🔑", record, LOCK_TTL)
    assert await postgres_store.finish("ключ-🔑", finished, TTL)

    stored = await postgres_store.get("ключ-🔑")
    assert stored is not None
    assert stored.response == response
    assert stored.key == "ключ-🔑"
    assert stored.request_fingerprint == record.request_fingerprint
    assert stored.fingerprint_version == record.fingerprint_version
    assert stored.created_at == pytest.approx(record.created_at, abs=1e-5)


#: A time whose microseconds ``datetime.fromtimestamp`` rounds down at a millisecond's edge
#: (…30.355999) where the record's wire form rounds them up (…30.356).
AT_A_MILLISECONDS_EDGE = 1796536950.3559995


async def test_times_read_back_as_the_record_wrote_them(postgres_store: PostgresStore) -> None:
    record = records.pending("edge", "owner-1", lock_ttl=LOCK_TTL, now=AT_A_MILLISECONDS_EDGE)
    finished = record.finished(
        RecordStatus.COMPLETED, StoredResponse(201, (), b"{}", None), record.expires_at
    )
    await postgres_store.try_acquire("edge", record, LOCK_TTL)
    assert await postgres_store.finish("edge", finished, TTL)
    stored = await postgres_store.get("edge")
    assert stored is not None
    assert record_to_dict(stored) == record_to_dict(finished)


@given(st.floats(min_value=0, max_value=4e9))
@example(AT_A_MILLISECONDS_EDGE)
def test_a_rows_time_formats_as_the_record_time_it_holds(epoch: float) -> None:
    assert _format_time(row_time(epoch).timestamp()) == _format_time(epoch)


async def test_release(postgres_store: PostgresStore) -> None:
    assert await postgres_store.release("absent", "anyone")

    await postgres_store.try_acquire("k", pending("owner-1"), LOCK_TTL)
    assert not await postgres_store.release("k", "owner-2")
    assert await postgres_store.get("k") is not None
    assert await postgres_store.release("k", "owner-1")
    assert await postgres_store.get("k") is None
    assert (await postgres_store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired


async def test_renew_extends_only_the_owners_live_lock(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    record = pending("owner-1")
    await postgres_store.try_acquire("k", record, 5)
    assert await deadline_in(sql, postgres_table, "k") == pytest.approx(5, abs=2)
    assert not await postgres_store.renew("k", "owner-2", 100)
    assert not await postgres_store.renew("absent", "owner-1", 100)
    assert await postgres_store.renew("k", "owner-1", 100)
    assert await deadline_in(sql, postgres_table, "k") == pytest.approx(100, abs=5)
    current = await postgres_store.get("k")
    assert current is not None
    assert record_to_dict(current) == record_to_dict(record)  # the record itself is unchanged


async def test_key_prefix_and_schema_qualified_table(postgres_dsn: str, sql: Any) -> None:
    schema = f"s_{uuid.uuid4().hex[:8]}"
    await sql.execute(f"CREATE SCHEMA {schema}")
    store = await PostgresStore.connect(postgres_dsn, table=f"{schema}.Keys", key_prefix="tenant")
    try:
        assert await store.create_schema()
        assert not await store.create_schema()  # idempotent
        await store.try_acquire("k", pending("owner-1"), LOCK_TTL)
        keys = await sql.fetch(f'SELECT key, idempotency_key FROM {schema}."Keys"')
        assert [tuple(row) for row in keys] == [("tenant:k", "client-key")]
        assert await store.claim_operation("POST /k", "app:k", "pod-1", 30) is None
        claims = await sql.fetch(f'SELECT operation, holder, code FROM {schema}."Keys_operations"')
        assert [tuple(row) for row in claims] == [("tenant:POST /k", "pod-1", "app:k")]
    finally:
        await store.aclose()


async def test_long_table_names_get_distinct_indexes(postgres_dsn: str, sql: Any) -> None:
    stem = "t" * 50 + uuid.uuid4().hex[:8]
    for table in (f"{stem}_a", f"{stem}_b"):
        store = await PostgresStore.connect(postgres_dsn, table=table)
        try:
            await store.create_schema()
        finally:
            await store.aclose()
        indexes = await sql.fetchval("SELECT count(*) FROM pg_indexes WHERE tablename = $1", table)
        assert indexes == 2  # primary key and expires_at


async def test_long_table_names_get_tables_of_claims_of_their_own(
    postgres_dsn: str, sql: Any
) -> None:
    """A name of 63 characters, the most PostgreSQL takes: the table of claims beside it is
    named by a cut of it and a hash, so that two such tables never share their claims."""
    stem = "t" + uuid.uuid4().hex[:8] + "t" * 52
    stores = [await PostgresStore.connect(postgres_dsn, table=f"{stem}_{n}") for n in "ab"]
    try:
        for store in stores:
            await store.create_schema()
        names = await sql.fetch(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE $1 ORDER BY 1",
            f"{stem[:43]}%_operations",
        )
        assert len(names) == 2
        assert all(len(row["tablename"]) == 63 for row in names)
        # Each store claims in its own table: other code is not refused by the other's claim.
        assert await stores[0].claim_operation("POST /a", "ledger:a", "pod-1", 30) is None
        assert await stores[1].claim_operation("POST /a", "notes:a", "pod-2", 30) is None
        assert await stores[0].claim_operation("POST /a", "notes:a", "pod-3", 30) == "ledger:a"
    finally:
        for store in stores:
            await store.aclose()


async def test_a_schema_made_before_the_claims_asks_for_migrate(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    """A table migrated by an earlier version has no table of claims beside it: claiming says
    which table to create and how, and purge_expired() still purges the records."""
    store = await PostgresStore.connect(postgres_dsn, table=postgres_table)
    try:
        await store.create_schema()
        await sql.execute(f'DROP TABLE "{postgres_table}_operations"')
        with pytest.raises(StoreError) as missing:
            await store.claim_operation("POST /a", "ledger:a", "pod-1", 30)
        assert f'table "{postgres_table}_operations" (the operation claims) does not exist' in str(
            missing.value
        )
        assert "run `starlette-idempotency migrate` or `await store.create_schema()`" in str(
            missing.value
        )
        with pytest.raises(StoreError, match="does not exist"):
            await store.release_operation("POST /a", "pod-1")
        await lapsed_lock(store, sql, postgres_table, "k", pending("owner-1"))
        assert await store.purge_expired() == 1
        await store.create_schema()  # migrate again: the claims work
        assert await store.claim_operation("POST /a", "ledger:a", "pod-1", 30) is None
    finally:
        await store.aclose()


async def test_purge_expired_deletes_lapsed_claims_only(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    store = postgres_store
    assert await store.claim_operation("POST /a", "ledger:a", "live", 30) is None
    assert await store.claim_operation("POST /b", "ledger:b", "lapsed", 30) is None
    await sql.execute(
        f"UPDATE \"{postgres_table}_operations\" SET expires_at = now() - interval '1 second' "
        "WHERE holder = 'lapsed'"
    )
    assert await store.purge_expired() == 0  # claims are not records
    holders = await sql.fetch(f'SELECT holder FROM "{postgres_table}_operations"')
    assert [row["holder"] for row in holders] == ["live"]


async def test_works_without_prepared_statement_cache(
    postgres_dsn: str, postgres_table: str
) -> None:
    """The setting to use behind PgBouncer in transaction pooling mode."""
    store = await PostgresStore.connect(postgres_dsn, table=postgres_table, statement_cache_size=0)
    try:
        await store.create_schema()
        record = pending("owner-1")
        assert (await store.try_acquire("k", record, LOCK_TTL)).acquired
        assert not (await store.try_acquire("k", pending("owner-2"), LOCK_TTL)).acquired
        assert await store.finish("k", completed(record), TTL)
        assert await store.get("k") is not None
        assert await store.release("k", "owner-1")
        assert await store.purge_expired() == 0
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "table", ["", "1abc", "a-b", "a;b", 'a"b', "a.b.c", "x" * 64, "drop table x", "a."]
)
def test_invalid_table_names_are_rejected(table: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid table name"):
        PostgresStore(table=table)


async def test_create_schema_concurrently(postgres_dsn: str, postgres_table: str) -> None:
    stores = [await PostgresStore.connect(postgres_dsn, table=postgres_table) for _ in range(4)]
    try:
        created = await asyncio.gather(*(store.create_schema() for store in stores))
        assert sorted(created) == [False, False, False, True]
    finally:
        for store in stores:
            await store.aclose()


async def test_aclose_closes_only_its_own_pool(postgres_dsn: str, postgres_table: str) -> None:
    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=1)
    try:
        store = PostgresStore(pool, table=postgres_table)
        await store.create_schema()
        await store.aclose()
        assert not pool.is_closing()
        assert await pool.fetchval("SELECT 1") == 1
    finally:
        await pool.close()

    async with await PostgresStore.connect(postgres_dsn, table=postgres_table) as own:
        assert await own.get("k") is None
    with pytest.raises(StoreError):
        await own.get("k")  # its pool is closed


async def test_unreachable_server_raises_store_error() -> None:
    with pytest.raises(StoreError) as caught:
        await PostgresStore.connect(f"postgresql://postgres@127.0.0.1:{free_port()}/postgres")
    assert isinstance(caught.value.__cause__, OSError)


async def test_store_error_while_server_is_down_and_recovery_after_restart(
    private_postgres: PostgresServer,
) -> None:
    store = await PostgresStore.connect(private_postgres.dsn, operation_timeout=5, max_size=3)
    try:
        await store.create_schema()
        assert (await store.try_acquire("k", pending("owner-1"), LOCK_TTL)).acquired

        private_postgres.stop()
        operations: list[Callable[[], Any]] = [
            lambda: store.get("k"),
            lambda: store.try_acquire("k2", pending("owner-2"), LOCK_TTL),
            lambda: store.finish("k", completed(pending("owner-1")), TTL),
            lambda: store.renew("k", "owner-1", LOCK_TTL),
            lambda: store.release("k", "owner-1"),
            lambda: store.purge_expired(),
        ]
        for operation in operations:
            with pytest.raises(StoreError) as caught:
                await operation()
            assert caught.value.__cause__ is not None

        private_postgres.start()
        # The same store, not recreated: the pool reconnects on its own.
        current = await store.get("k")
        assert current is not None
        assert current.owner_token == "owner-1"
        assert (await store.try_acquire("k2", pending("owner-2"), LOCK_TTL)).acquired
        assert await store.release("k", "owner-1")
    finally:
        await store.aclose()


async def test_blocked_statement_raises_store_timeout_error(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    store = await PostgresStore.connect(postgres_dsn, table=postgres_table, operation_timeout=0.3)
    try:
        await store.create_schema()
        record = pending("owner-1")
        await store.try_acquire("k", record, LOCK_TTL)
        async with rows_locked(sql, postgres_table):
            with pytest.raises(StoreTimeoutError):
                await store.finish("k", completed(record), TTL)
        assert await store.finish("k", completed(record), TTL)  # the pool is fine after it
    finally:
        await store.aclose()


async def test_an_expired_outcome_a_purge_holds_is_waited_for(
    postgres_store: PostgresStore, postgres_table: str, sql: Any
) -> None:
    """A purge keeps its batch's rows locked until its statement ends. A new request's takeover
    skipped the expired row and gave up after 150 ms: 503, for as long as the purge ran."""
    old = pending("owner-old")
    await postgres_store.try_acquire("k", old, LOCK_TTL)
    await postgres_store.finish("k", completed(old), TTL)
    await expire(sql, postgres_table, "k")
    async with rows_locked(sql, postgres_table):  # the purge's batch, for a while
        acquiring = asyncio.create_task(postgres_store.try_acquire("k", pending("new"), LOCK_TTL))
        await asyncio.sleep(0.4)  # longer than a statement's lock is waited for
        assert not acquiring.done()
        await sql.execute(f"DELETE FROM {postgres_table}")
    assert (await acquiring).acquired
    current = await postgres_store.get("k")
    assert current is not None
    assert current.owner_token == "new"


async def test_server_side_statement_timeout_is_a_store_timeout_error(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    store = await PostgresStore.connect(
        postgres_dsn,
        table=postgres_table,
        server_settings={"statement_timeout": "200"},
        max_size=1,
    )
    try:
        await store.create_schema()
        record = pending("owner-1")
        await store.try_acquire("k", record, LOCK_TTL)
        async with rows_locked(sql, postgres_table):
            with pytest.raises(StoreTimeoutError) as caught:
                await store.renew("k", "owner-1", LOCK_TTL)
        assert isinstance(caught.value.__cause__, asyncpg.QueryCanceledError)
    finally:
        await store.aclose()


async def test_exhausted_pool_raises_store_timeout_error(
    postgres_dsn: str, postgres_table: str
) -> None:
    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=1)
    try:
        store = PostgresStore(pool, table=postgres_table, operation_timeout=0.2)
        await store.create_schema()
        async with pool.acquire():
            with pytest.raises(StoreTimeoutError):
                await store.get("k")
        assert await store.get("k") is None
    finally:
        await pool.close()


async def test_purge_expired_deletes_exactly_the_expired_rows_in_batches(
    logged: tuple[PostgresStore, StatementLog], postgres_table: str, sql: Any
) -> None:
    store, log = logged
    await sql.execute(
        f"""
        INSERT INTO {postgres_table} (key, idempotency_key, status, request_fingerprint,
                                      owner_token, created_at, expires_at)
        SELECT 'idempotency:' || kind || n, kind || n, 'Completed', 'fp', 'owner', now(),
               CASE kind WHEN 'old' THEN now() - interval '1 minute'
                         ELSE now() + interval '1 hour' END
        FROM generate_series(1, 2500) AS n, (VALUES ('old'), ('live')) AS kinds (kind)
        WHERE kind = 'old' OR n <= 100
        """
    )
    await log.take()

    async def acquire_live_keys() -> list[bool]:
        outcomes = []
        for n in range(50):
            record = pending(f"racer-{n}", key=f"new{n}")
            outcomes.append((await store.try_acquire(f"new{n}", record, LOCK_TTL)).acquired)
            outcomes.append(not (await store.try_acquire(f"live{n + 1}", record, 5)).acquired)
            written = await store.finish(f"new{n}", completed(record), TTL)
            outcomes.append(written is FencedWrite.WRITTEN)
        return outcomes

    deleted, outcomes = await asyncio.gather(
        store.purge_expired(batch_size=1000), acquire_live_keys()
    )
    assert deleted == 2500
    assert all(outcomes)
    deletes = [query for query in await log.take() if "DELETE" in query]
    purges = [query for query in deletes if f'"{postgres_table}_operations"' not in query]
    assert len(purges) == 3  # 1000 + 1000 + 500
    assert len(deletes) == 4  # and the lapsed operation claims, first
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table} WHERE key LIKE '%old%'") == 0
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 150
    assert await store.purge_expired() == 0


async def test_purge_rejects_a_bad_batch_size(postgres_store: PostgresStore) -> None:
    with pytest.raises(ConfigurationError):
        await postgres_store.purge_expired(batch_size=0)


def test_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette_idempotency.stores._postgres_connections import asyncpg_driver

    monkeypatch.setitem(sys.modules, "asyncpg", None)
    with pytest.raises(ImportError, match=r"starlette-idempotency\[postgres\]"):
        asyncpg_driver()
