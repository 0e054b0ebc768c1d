"""PostgresStore's SQL: the named queries of ``sql/queries.sql`` filled in for one table and
key prefix, the parameters each takes, and rows read back as records.

A statement is a value, :class:`Statement` (a query's name and its arguments), built here and
run by whoever holds the connection: the store on its pool, each statement its own short
transaction, or ``idempotency_transaction`` on the app's connection, inside the app's
transaction. Either way the same SQL writes the same rows.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any, NamedTuple

import orjson

from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    checkpoints_from_wire,
    checkpoints_to_wire,
)
from starlette_idempotency.errors import ConfigurationError

DEFAULT_TABLE = "idempotency_keys"

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_$]{0,62}"
_TABLE_NAME = re.compile(rf"(?:({_IDENTIFIER})\.)?({_IDENTIFIER})")
_QUERY_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


class TableNames(NamedTuple):
    """The quoted names of the records table, its expiry index, and the table of operation
    claims beside it (``<table>_operations``, in the same schema)."""

    table: str
    expiry_index: str
    operations: str


def quote_table(table: str) -> TableNames:
    """The quoted names of ``table`` and of what goes with it, validated."""
    match = _TABLE_NAME.fullmatch(table)
    if match is None:
        raise ConfigurationError(
            f"invalid table name {table!r}: use an identifier (letters, digits, _ and $, "
            "at most 63 characters), optionally schema-qualified as schema.table"
        )
    schema, name = match.groups()
    qualified = "" if schema is None else f'"{schema}".'
    # Derived names share the 63-byte limit: a long table name is cut and made unique by a
    # hash, since CREATE ... IF NOT EXISTS would skip the index or table of a second table with
    # the same cut. (The index's cut is the one tables made before the claims existed carry.)
    return TableNames(
        f'{qualified}"{name}"',
        f'"{_cut(name, 47)}_expires_at_idx"',
        f'{qualified}"{_cut(name, 52)}_operations"',
    )


def shown(quoted: str) -> str:
    """A name :func:`quote_table` quoted, as messages show it (``public.keys_operations``)."""
    return quoted.replace('"', "")


def _cut(name: str, limit: int) -> str:
    """``name``, or when longer than ``limit``, its start and a hash of it, ``limit`` long."""
    if len(name) <= limit:
        return name
    return f"{name[: limit - 9]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def schema_sql(table: str = DEFAULT_TABLE) -> str:
    """The DDL :meth:`PostgresStore.create_schema` runs for ``table`` (what ``starlette-idempotency
    migrate --sql`` prints, for a migration tool): every statement ``IF NOT EXISTS``."""
    names = quote_table(table)
    return (
        _sql_file("schema.sql")
        .replace("{table}", names.table)
        .replace("{index}", names.expiry_index)
        .replace("{operations}", names.operations)
    )


@cache
def _sql_file(name: str) -> str:
    return (
        resources.files("starlette_idempotency.stores")
        .joinpath("sql", name)
        .read_text(encoding="utf-8")
    )


@cache
def named_queries(file: str) -> dict[str, str]:
    """A file of named queries split at its ``-- name:`` lines, comment lines dropped."""
    parts = _QUERY_NAME.split(_sql_file(file))
    return {
        name: "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
        .strip()
        .rstrip(";")
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def checkpoints_json(record: IdempotencyRecord) -> str | None:
    if not record.checkpoints:
        return None
    return orjson.dumps(checkpoints_to_wire(record.checkpoints)).decode()


def record_from_row(row: Mapping[str, Any]) -> IdempotencyRecord:
    """A record from the "record columns" that ``get`` and ``acquire_takeover`` select."""
    response = None
    if row["response_status_code"] is not None:
        headers = orjson.loads(row["response_headers"] or "[]")
        response = StoredResponse(
            status_code=row["response_status_code"],
            headers=tuple((str(name), str(value)) for name, value in headers),
            body=bytes(row["response_body"] or b""),
            content_type=row["response_content_type"],
        )
    lease_until = row["lease_until"]
    return IdempotencyRecord(
        key=row["idempotency_key"],
        status=RecordStatus(row["status"]),
        request_fingerprint=row["request_fingerprint"],
        fingerprint_version=row["fingerprint_version"],
        owner_token=row["owner_token"],
        created_at=row["created_at"].timestamp(),
        expires_at=row["record_expires_at"].timestamp(),
        response=response,
        locked_until=None if lease_until is None else lease_until.timestamp(),
        checkpoints=checkpoints_from_wire(orjson.loads(row["checkpoints"] or "[]")),
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def row_time(epoch: float) -> datetime:
    """A record's time as its row's ``timestamptz``: rounded to the microsecond as the record's
    wire form rounds it (``round(epoch * 1e6)``), so that the record read back formats as it
    was written. ``datetime.fromtimestamp`` rounds the fraction alone, which at a
    millisecond's edge can land a microsecond lower, a millisecond earlier once formatted."""
    return _EPOCH + timedelta(microseconds=round(epoch * 1_000_000))


def row_params(storage_key: str, record: IdempotencyRecord, ttl: float) -> tuple[Any, ...]:
    """The "row parameters" ($1 to $14) of ``queries.sql``."""
    response = record.response
    return (
        storage_key,
        record.key,
        record.status.value,
        record.request_fingerprint,
        record.fingerprint_version,
        record.owner_token,
        response.status_code if response else None,
        orjson.dumps([list(pair) for pair in response.headers]).decode() if response else None,
        response.body if response else None,
        response.content_type if response else None,
        row_time(record.created_at),
        row_time(record.expires_at),
        float(ttl),
        checkpoints_json(record),
    )


class Statement(NamedTuple):
    """One named query of ``queries.sql`` and its arguments."""

    query: str
    args: tuple[Any, ...]


class TableQueries:
    """The queries of ``queries.sql`` and ``operator.sql`` for one table and key prefix
    (``sql``, by name), and the statements of the writes that may also run in the app's
    transaction."""

    def __init__(self, table: str, key_prefix: str) -> None:
        names = quote_table(table)
        self.table, self.operations = names.table, names.operations
        self.prefix = f"{key_prefix}:"
        self.sql = {
            name: query.replace("{table}", self.table).replace("{operations}", self.operations)
            for file in ("queries.sql", "operator.sql")
            for name, query in named_queries(file).items()
        }

    def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> Statement:
        return Statement("finish", row_params(self.prefix + key, record, ttl))

    def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float, *, fenced: bool
    ) -> Statement:
        """``fenced``: in the transaction whose ``fence`` locked the row."""
        return Statement(
            "save_progress",
            (
                self.prefix + key,
                record.owner_token,
                checkpoints_json(record),
                float(lease),
                row_time(record.expires_at),
                float(ttl),
                fenced,
            ),
        )

    def fence(self, key: str, owner_token: str) -> Statement:
        return Statement("fence", (self.prefix + key, owner_token))
