"""What :meth:`PostgresStore.check` reports, from the one row its ``check`` query reads: the
table and its columns, the table of operation claims and the role's rights on it, whether the
database can be written, and what a crash would lose; and what a statement says when a table
is missing or the role may not use it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores._postgres_connections import asyncpg_driver
from starlette_idempotency.stores._postgres_sql import shown
from starlette_idempotency.stores.base import StoreFinding

#: The columns of schema.sql, all used by the queries (the check reports the missing ones).
COLUMNS = (
    "key",
    "idempotency_key",
    "status",
    "request_fingerprint",
    "fingerprint_version",
    "owner_token",
    "response_status_code",
    "response_headers",
    "response_body",
    "response_content_type",
    "created_at",
    "record_expires_at",
    "locked_until",
    "checkpoints",
    "expires_at",
)
#: What creates the tables a database lacks.
MIGRATE_HINT = "run `starlette-idempotency migrate` or `await store.create_schema()`"
#: The rights the operation claims need on their table: ``claim_write`` upserts and locks rows,
#: ``claim_check``, ``unclaim`` and ``purge_claims`` read and delete them.
CLAIMS_RIGHTS = ("SELECT", "INSERT", "UPDATE", "DELETE")


def undefined_table(exc: StoreError) -> bool:
    """Whether ``exc`` says that a table the statement names does not exist."""
    return isinstance(exc.__cause__, asyncpg_driver().UndefinedTableError)


def insufficient_privilege(exc: StoreError) -> bool:
    """Whether ``exc`` says that the role lacks a right the statement needs."""
    return isinstance(exc.__cause__, asyncpg_driver().InsufficientPrivilegeError)


def claims_grant(claims_table: str, role: str, rights: Sequence[str] = CLAIMS_RIGHTS) -> str:
    """The statement that gives ``role`` ``rights`` on ``claims_table`` (quoted)."""
    return f"GRANT {', '.join(rights)} ON {claims_table} TO {role}"


@contextlib.contextmanager
def claims_table_needed(claims_table: str, location: str | None) -> Iterator[None]:
    """A statement's failure for want of the table of operation claims (a schema made before
    them) raised as what says how to create it."""
    try:
        yield
    except StoreError as exc:
        if not undefined_table(exc):
            raise
        raise StoreError(
            f"table {claims_table} (the operation claims) does not exist in {location}: "
            f"{MIGRATE_HINT} to create it; until then this app claims no operations"
        ) from exc


def findings(
    row: Mapping[str, Any], *, table: str, claims_table: str, location: str | None
) -> list[StoreFinding]:
    """What the ``check`` query's ``row`` says about the database at ``location``;
    ``claims_table`` is quoted, as a statement names it."""
    where = f"table {table} in {location}"
    claims_where = f"table {shown(claims_table)} in {location}"
    missing = ", ".join(row["missing_columns"] or ())
    missing_rights = row["missing_claims_rights"] or []
    why = "a standby" if row["standby"] else "transaction_read_only is on"
    candidates: list[tuple[bool, Literal["error", "warning"], str]] = [
        (not row["table_exists"], "error", f"{where} does not exist: {MIGRATE_HINT}"),
        (
            row["table_exists"] and bool(missing),
            "error",
            f"{where} lacks column(s) {missing}: {MIGRATE_HINT}",
        ),
        (row["read_only"], "error", f"{location} is read-only ({why}): no key can be acquired"),
        (
            bool(row["unlogged"]),
            "warning",
            f"{where} is UNLOGGED: a crash empties it and standbys never see it, "
            "so retries after a crash or failover run their requests again",
        ),
        (
            row["synchronous_commit"] == "off",
            "warning",
            "synchronous_commit is off: a server crash can lose acquires that were "
            "already answered, and the retries of those requests then run again",
        ),
        (
            row["fsync_off"],
            "warning",
            "fsync is off: a crash of the database machine can lose or corrupt records",
        ),
        (
            row["table_exists"] and not row["operations_table_exists"],
            "warning",
            f"{claims_where} does not exist (a schema made before the operation claims): "
            "apps make no claims, so two services on this table are not told apart: "
            f"{MIGRATE_HINT}",
        ),
        (
            bool(missing_rights),
            "warning",
            f"role {row['role']} lacks {', '.join(missing_rights)} on {claims_where} (the "
            "operation claims): apps make no claims, so two services on this table are not "
            "told apart, and purge leaves the lapsed claims: run "
            f"{claims_grant(claims_table, row['role'], missing_rights)}",
        ),
    ]
    return [StoreFinding(level, message) for found, level, message in candidates if found]
