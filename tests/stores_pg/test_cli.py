"""The ``starlette-idempotency`` command, run as a subprocess against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency.testing._process import free_port

pytestmark = pytest.mark.postgres


@dataclass
class Ran:
    code: int
    out: str
    err: str


async def cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    environment = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    environment.update(env or {})
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "starlette_idempotency.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return Ran(process.returncode, out.decode(), err.decode())


@pytest.fixture
async def sql(postgres_dsn: str) -> AsyncIterator[Any]:
    connection = await asyncpg.connect(postgres_dsn)
    yield connection
    await connection.close()


async def test_migrate_creates_the_table_once(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    first = await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)
    assert first.code == 0, first.err
    assert first.out.strip() == f"migrate: created table {postgres_table} and its expires_at index"

    second = await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)
    assert second.code == 0, second.err
    assert "already exists" in second.out

    indexes = await sql.fetch(
        "SELECT indexdef FROM pg_indexes WHERE tablename = $1", postgres_table
    )
    assert any("(expires_at)" in row["indexdef"] for row in indexes)


async def test_purge_deletes_expired_rows_and_reads_database_url(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    assert (await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)).code == 0
    await sql.execute(
        f"""
        INSERT INTO {postgres_table} (key, idempotency_key, status, request_fingerprint,
                                      owner_token, created_at, expires_at)
        SELECT 'idempotency:k' || n, 'k' || n, 'Completed', 'fp', 'owner', now(),
               now() + CASE WHEN n <= 7 THEN interval '-1 minute' ELSE interval '1 hour' END
        FROM generate_series(1, 10) AS n
        """
    )
    purged = await cli(
        "purge", "--table", postgres_table, "--batch-size", "3", env={"DATABASE_URL": postgres_dsn}
    )
    assert purged.code == 0, purged.err
    assert purged.out.strip() == f"purge: deleted 7 expired row(s) from {postgres_table}"
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 3


async def test_unreachable_database_is_a_one_line_error() -> None:
    ran = await cli("migrate", "--dsn", f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    assert ran.code == 1
    assert ran.out == ""
    lines = ran.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("starlette-idempotency: error: PostgreSQL connect failed")


async def test_usage_errors() -> None:
    no_dsn = await cli("purge")
    assert no_dsn.code == 2
    assert "pass --dsn or set DATABASE_URL" in no_dsn.err

    bad_table = await cli("migrate", "--dsn", "postgresql://localhost/x", "--table", "a;b")
    assert bad_table.code == 2
    assert "invalid table name" in bad_table.err

    bad_batch = await cli("purge", "--dsn", "postgresql://localhost/x", "--batch-size", "0")
    assert bad_batch.code == 2
