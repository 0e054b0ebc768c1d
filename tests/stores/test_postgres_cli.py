"""The ``starlette-idempotency`` command, run as a subprocess against a real PostgreSQL:
``migrate``, ``purge`` and ``doctor --dsn``."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest

from starlette_idempotency.stores._postgres_connections import location_of
from starlette_idempotency.testing._processes import free_port
from tests.support.cli import Ran, assert_unreachable
from tests.support.cli import cli as run_cli
from tests.support.postgres import a_role

pytestmark = pytest.mark.postgres


async def cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    return await asyncio.to_thread(run_cli, *args, env=env)


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


async def seven_of_ten_expired(sql: Any, table: str) -> None:
    """Ten records in ``table``, seven of them expired."""
    await sql.execute(
        f"""
        INSERT INTO {table} (key, idempotency_key, status, request_fingerprint,
                             owner_token, created_at, expires_at)
        SELECT 'idempotency:k' || n, 'k' || n, 'Completed', 'fp', 'owner', now(),
               now() + CASE WHEN n <= 7 THEN interval '-1 minute' ELSE interval '1 hour' END
        FROM generate_series(1, 10) AS n
        """
    )


async def test_purge_deletes_expired_rows_and_reads_database_url(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    assert (await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)).code == 0
    await seven_of_ten_expired(sql, postgres_table)
    purged = await cli(
        "purge", "--table", postgres_table, "--batch-size", "3", env={"DATABASE_URL": postgres_dsn}
    )
    assert purged.code == 0, purged.err
    assert purged.out.strip() == f"purge: deleted 7 expired row(s) from {postgres_table}"
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 3


async def test_a_role_without_rights_on_the_claims_purges_and_is_told_what_to_grant(
    postgres_dsn: str, postgres_table: str, sql: Any
) -> None:
    """The claims' purge refused must not keep the records from being purged."""
    assert (await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)).code == 0
    await seven_of_ten_expired(sql, postgres_table)
    claims, role = f"{postgres_table}_operations", f"{postgres_table}_app"
    rights = f"SELECT, INSERT, UPDATE, DELETE ON {postgres_table}"
    async with a_role(sql, postgres_dsn, role, rights) as as_app:
        purged = await cli("purge", "--dsn", as_app, "--table", postgres_table)
        doctor = await cli("doctor", "--dsn", as_app, "--table", postgres_table)
    assert purged.code == 0, purged.err
    assert purged.out.strip() == f"purge: deleted 7 expired row(s) from {postgres_table}"
    assert f"permission denied for table {claims}" in purged.err
    assert f'Run GRANT SELECT, INSERT, UPDATE, DELETE ON "{claims}" TO ' in purged.err
    assert await sql.fetchval(f"SELECT count(*) FROM {postgres_table}") == 3

    assert doctor.code == 0, doctor.out + doctor.err
    [warning] = [line for line in doctor.lines if claims in line]
    assert warning.startswith(f"warning: role {role} lacks SELECT, INSERT, UPDATE, DELETE on ")
    assert warning.endswith(f'run GRANT SELECT, INSERT, UPDATE, DELETE ON "{claims}" TO {role}')


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


async def test_purge_before_migrate_says_to_run_migrate(
    postgres_dsn: str, postgres_table: str
) -> None:
    where = f"postgres at {location_of(postgres_dsn, {})} table {postgres_table}"
    ran = await cli("purge", "--dsn", postgres_dsn, "--table", postgres_table)
    assert (ran.code, ran.out) == (1, "")
    assert ran.err.splitlines() == [
        f"starlette-idempotency: error: {where} does not exist: run "
        f"`starlette-idempotency migrate --table {postgres_table}` with the same --dsn first"
    ]
    from_env = await cli("purge", "--table", postgres_table, env={"DATABASE_URL": postgres_dsn})
    assert from_env.code == 1
    assert from_env.err.splitlines()[-1].endswith("with the same DATABASE_URL first")


async def test_doctor_on_a_migrated_table(postgres_dsn: str, postgres_table: str, sql: Any) -> None:
    assert (await cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table)).code == 0
    expected = [
        phrase
        for setting, phrase in [
            ("fsync", "fsync is off"),
            ("synchronous_commit", "synchronous_commit is off"),
        ]
        if await sql.fetchval(f"SHOW {setting}") == "off"
    ]
    ran = await cli("doctor", "--dsn", postgres_dsn, "--table", postgres_table)
    assert ran.code == 0, ran.out + ran.err
    assert ran.lines[0] == (
        f"doctor: checking postgres at {location_of(postgres_dsn, {})} table {postgres_table}"
    )
    findings = ran.lines[1:-1]
    assert len(findings) == len(expected), ran.out
    assert all(finding.startswith("warning: ") for finding in findings), ran.out
    assert all(any(phrase in finding for finding in findings) for phrase in expected), ran.out
    counts = f"0 errors, {len(findings)} warning{'s' * (len(findings) != 1)}"
    assert ran.lines[-1].startswith(f"doctor: {counts}: ")
    password = urlsplit(postgres_dsn).password if "://" in postgres_dsn else None
    assert not password or password not in ran.out + ran.err

    strict = await cli("doctor", "--dsn", postgres_dsn, "--table", postgres_table, "--strict")
    assert strict.code == (1 if findings else 0)


async def test_doctor_without_the_table_says_to_run_migrate(
    postgres_dsn: str, postgres_table: str
) -> None:
    ran = await cli("doctor", "--table", postgres_table, env={"DATABASE_URL": postgres_dsn})
    assert ran.code == 1, ran.out + ran.err
    errors = [line for line in ran.lines if line.startswith("error: ")]
    assert len(errors) == 1, ran.out
    assert errors[0].startswith(
        f"error: table {postgres_table} in {location_of(postgres_dsn, {})} does not exist: "
    )
    assert "starlette-idempotency migrate" in errors[0]
    assert ran.lines[-1].startswith("doctor: 1 error, ")


async def test_doctor_on_an_unreachable_database_is_an_error() -> None:
    port = free_port()
    ran = await cli("doctor", "--dsn", f"postgresql://app:s3cret@127.0.0.1:{port}/payments")
    where = f"postgres at 127.0.0.1:{port}/payments table idempotency_keys"
    assert_unreachable(ran, where, f"error: {where} is unreachable: ", secret="s3cret")
