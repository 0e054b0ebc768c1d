"""``starlette-idempotency migrate --sql`` and the Alembic revision of docs/how-to/postgres.md,
applied to a real PostgreSQL: each must make the tables ``migrate`` makes (the records and the
operation claims), column for column."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import pytest

from starlette_idempotency import __version__
from starlette_idempotency.testing._isolation import run_database
from tests.support.cli import cli
from tests.support.readme_blocks import read_blocks

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "how-to" / "postgres.md"


def statements(sql: str) -> list[str]:
    """The statements of a script, comments dropped and whitespace runs made one space."""
    code = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [" ".join(part.split()) for part in code.split(";") if part.strip()]


def printed_ddl(table: str | None = None) -> str:
    ran = cli("migrate", "--sql", *(["--table", table] if table else []))
    assert ran.code == 0, ran.err
    assert ran.err == ""
    return ran.out


async def table_shape(connection: Any, table: str) -> dict[str, Any]:
    """What makes the table what it is, with its own name taken out of the index names."""
    columns = await connection.fetch(
        """
        SELECT column_name, data_type, is_nullable, column_default
        FROM information_schema.columns
        WHERE table_schema = current_schema() AND table_name = $1
        ORDER BY ordinal_position
        """,
        table,
    )
    constraints = await connection.fetch(
        "SELECT contype, pg_get_constraintdef(oid) AS definition FROM pg_constraint "
        "WHERE conrelid = to_regclass($1) ORDER BY 1, 2",
        f'"{table}"',
    )
    indexes = await connection.fetch(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() AND tablename = $1 "
        "ORDER BY indexdef",
        table,
    )
    shape = {
        "columns": [tuple(row) for row in columns],
        "constraints": [tuple(row) for row in constraints],
        "indexes": [row["indexdef"].replace(table, "<table>") for row in indexes],
    }
    assert shape["columns"], f"no table {table}"
    return shape


@pytest.mark.postgres
async def test_the_printed_ddl_makes_the_table_migrate_makes(
    postgres_dsn: str, postgres_table: str
) -> None:
    printed_table, migrated_table = f"{postgres_table}_sql", f"{postgres_table}_cli"
    ddl = printed_ddl(printed_table)
    assert ddl.startswith(f"-- starlette-idempotency {__version__}: migrate --table ")
    ran = cli("migrate", "--dsn", postgres_dsn, "--table", migrated_table)
    assert ran.code == 0, ran.err

    connection = await asyncpg.connect(postgres_dsn)
    try:
        await connection.execute(ddl)  # as psql -f or Flyway runs the file
        await connection.execute(ddl)  # and safe to run again
        for suffix in ("", "_operations"):
            assert await table_shape(connection, printed_table + suffix) == await table_shape(
                connection, migrated_table + suffix
            )
    finally:
        await connection.close()


def test_the_printed_ddl_needs_no_database_and_refuses_a_dsn() -> None:
    # tests.support.cli runs it without DATABASE_URL: nothing to connect to, and no need.
    assert statements(printed_ddl())[0].startswith(
        'CREATE TABLE IF NOT EXISTS "idempotency_keys" ('
    )
    schema = statements(printed_ddl("billing.keys"))
    assert schema[-2] == (
        'CREATE INDEX IF NOT EXISTS "keys_expires_at_idx" ON "billing"."keys" (expires_at)'
    )
    assert schema[-1].startswith('CREATE TABLE IF NOT EXISTS "billing"."keys_operations" (')

    with_dsn = cli("migrate", "--sql", "--dsn", "postgresql://db/app")
    assert with_dsn.code == 2
    assert "--sql prints the DDL without connecting: drop --dsn" in with_dsn.err
    bad_table = cli("migrate", "--sql", "--table", 'keys"; DROP TABLE x; --')
    assert bad_table.code == 2
    assert "invalid table name" in bad_table.err
    assert bad_table.out == ""


def alembic_revision() -> str:
    (block,) = [b for b in read_blocks(GUIDE.read_text()) if "from alembic import op" in b.source]
    return block.source


def executed_statements(revision: str) -> list[str]:
    """The string each ``op.execute`` of ``upgrade()`` is given, read from the source."""
    tree = ast.parse(revision)
    (upgrade,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade"]
    calls = [
        call
        for call in ast.walk(upgrade)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "op.execute"
    ]
    return [" ".join(str(ast.literal_eval(call.args[0])).split()) for call in calls]


def test_the_docs_alembic_revision_runs_what_migrate_prints() -> None:
    revision = alembic_revision()
    assert executed_statements(revision) == statements(printed_ddl())
    (docstring_version,) = re.findall(r"migrate --sql`, (\S+)\)", revision)
    assert docstring_version == __version__


def alembic(project: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.postgres
async def test_the_docs_alembic_revision_upgrades_and_downgrades_a_real_database(
    tmp_path: Path, postgres_admin_dsn: str, postgres_dsn: str, postgres_table: str
) -> None:
    """``alembic init -t async`` (SQLAlchemy's asyncpg driver, as a FastAPI app on asyncpg
    would set it up), the revision from the docs, ``alembic upgrade head`` and back."""
    alembic(tmp_path, "init", "-t", "async", "migrations")
    ini = tmp_path / "alembic.ini"
    with run_database(postgres_admin_dsn) as dsn:
        url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
        ini.write_text(
            re.sub(r"(?m)^sqlalchemy\.url = .*$", f"sqlalchemy.url = {url}", ini.read_text())
        )
        (tmp_path / "migrations" / "versions" / "5e1d0c7a9b42_idempotency.py").write_text(
            alembic_revision()
        )
        assert "5e1d0c7a9b42" in alembic(tmp_path, "upgrade", "head")

        reference = await asyncpg.connect(postgres_dsn)
        migrated = await asyncpg.connect(dsn)
        try:
            assert cli("migrate", "--dsn", postgres_dsn, "--table", postgres_table).code == 0
            for suffix in ("", "_operations"):
                assert await table_shape(
                    migrated, "idempotency_keys" + suffix
                ) == await table_shape(reference, postgres_table + suffix)
            alembic(tmp_path, "downgrade", "base")
            for table in ("idempotency_keys", "idempotency_keys_operations"):
                assert await migrated.fetchval("SELECT to_regclass($1)", table) is None
        finally:
            await migrated.close()
            await reference.close()
