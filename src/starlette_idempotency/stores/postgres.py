"""PostgreSQL store: one row per key, INSERT-first ownership, every later write fenced by SQL.

Needs the ``postgres`` extra (asyncpg): ``pip install 'starlette-idempotency[postgres]'``. The
SQL lives in ``sql/schema.sql`` and ``sql/queries.sql`` beside this module.

Statements per operation (each one statement, so its own short transaction):

* ``try_acquire``: 1 on a free key (``INSERT ... ON CONFLICT DO NOTHING``); 2 when a row is
  there (then one statement takes an expired row over, returning its old values, or reads the
  live holder). It starts again, a few times at most, only when the row changes in between.
* ``complete`` / ``fail`` / ``release`` / ``renew`` / ``get``: 1 each, no read first.
* ``purge_expired``: 1 per batch.

Expiry is decided by the database clock (``now()`` plus the TTL argument), so pods with skewed
clocks agree. The record's own ``created_at`` and ``expires_at`` are stored and returned as the
middleware set them, as data only. Expired rows are invisible at once and deleted by
:meth:`PostgresStore.purge_expired` (run it from cron: ``starlette-idempotency purge``).

Behind PgBouncer in transaction pooling mode, create the pool with
``statement_cache_size=0`` (asyncpg's named prepared statements do not survive a change of
server connection); nothing else in the store depends on session state.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from types import TracebackType
from typing import Any, NoReturn, Protocol

import orjson

from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError
from starlette_idempotency.record import (
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    checkpoints_from_wire,
    checkpoints_to_wire,
)
from starlette_idempotency.stores.base import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_RESOLVED_TTL,
    AcquireResult,
    resolve_record,
)

DEFAULT_TABLE = "idempotency_keys"
DEFAULT_OPERATION_TIMEOUT = 10.0

# A row can change between the two statements of try_acquire (released, or taken over and
# finished); then it starts again. Running out of attempts needs sustained churn on one key.
_ACQUIRE_ATTEMPTS = 5

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_$]{0,62}"
_TABLE_NAME = re.compile(rf"(?:({_IDENTIFIER})\.)?({_IDENTIFIER})")
_QUERY_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


class PoolLike(Protocol):
    """The part of ``asyncpg.Pool`` the store uses."""

    async def fetchrow(self, query: str, *args: Any) -> Any: ...

    async def fetchval(self, query: str, *args: Any) -> Any: ...

    def acquire(self) -> Any: ...


def _asyncpg() -> Any:
    try:
        import asyncpg  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - the test environment has asyncpg
        raise ImportError(
            "PostgresStore needs asyncpg: pip install 'starlette-idempotency[postgres]'"
        ) from exc
    return asyncpg


def _quote_table(table: str) -> tuple[str, str]:
    """The quoted table name and the quoted name of its expiry index."""
    match = _TABLE_NAME.fullmatch(table)
    if match is None:
        raise ConfigurationError(
            f"invalid table name {table!r}: use an identifier (letters, digits, _ and $, "
            "at most 63 characters), optionally schema-qualified as schema.table"
        )
    schema, name = match.groups()
    quoted = f'"{name}"' if schema is None else f'"{schema}"."{name}"'
    # Index names share the 63-byte limit: a long table name is cut and made unique by a hash,
    # since CREATE INDEX IF NOT EXISTS would skip the index of a second table with the same cut.
    stem = name if len(name) <= 47 else f"{name[:38]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return quoted, f'"{stem}_expires_at_idx"'


@cache
def _sql_file(name: str) -> str:
    return (
        resources.files("starlette_idempotency.stores")
        .joinpath("sql", name)
        .read_text(encoding="utf-8")
    )


@cache
def _named_queries() -> dict[str, str]:
    """``queries.sql`` split at its ``-- name:`` lines, comment lines dropped."""
    parts = _QUERY_NAME.split(_sql_file("queries.sql"))
    return {
        name: "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("--"))
        .strip()
        .rstrip(";")
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def _raise_store_error(exc: Exception, operation: str) -> NoReturn:
    """Re-raise a driver or network error as a :class:`StoreError`; anything else as it is."""
    asyncpg = _asyncpg()
    message = f"PostgreSQL {operation} failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError | asyncpg.QueryCanceledError):
        raise StoreTimeoutError(message) from exc
    if isinstance(exc, asyncpg.ClientConfigurationError):
        raise ConfigurationError(message) from exc
    if isinstance(
        exc, OSError | asyncpg.PostgresError | asyncpg.InterfaceError | asyncpg.InternalClientError
    ):
        raise StoreError(message) from exc
    raise exc


async def _keep_session(connection: Any) -> None:
    """A pool ``reset`` that sends nothing (see :meth:`PostgresStore.connect`)."""


def _checkpoints_json(record: IdempotencyRecord) -> str | None:
    if not record.checkpoints:
        return None
    return orjson.dumps(checkpoints_to_wire(record.checkpoints)).decode()


def _record_from_row(row: Mapping[str, Any]) -> IdempotencyRecord:
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


class PostgresStore:
    """Idempotency records in one PostgreSQL table, shared by every process that uses it.

    Pass your own asyncpg pool (it stays open on :meth:`aclose`) or let :meth:`connect` open
    one. Call :meth:`create_schema` once (or run ``starlette-idempotency migrate``) before use.
    ``operation_timeout`` (seconds) bounds each operation, the wait for a pooled connection
    included; past it the operation raises :class:`~starlette_idempotency.errors.StoreTimeoutError`.
    ``None`` waits forever.
    """

    name = "postgres"
    supports_recovery = True

    def __init__(
        self,
        pool: PoolLike,
        *,
        table: str = DEFAULT_TABLE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        self._pool = pool
        self._owned_pool: Any = None
        self._table, index = _quote_table(table)
        self._prefix = f"{key_prefix}:"
        self._timeout = operation_timeout
        self._sql = {
            name: query.replace("{table}", self._table) for name, query in _named_queries().items()
        }
        self._schema = (
            _sql_file("schema.sql").replace("{table}", self._table).replace("{index}", index)
        )

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        table: str = DEFAULT_TABLE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
        **pool_options: Any,
    ) -> PostgresStore:
        """Open an asyncpg pool on ``dsn`` (closed again by :meth:`aclose`).

        ``pool_options`` go to ``asyncpg.create_pool`` (``min_size`` defaults to 1, and the
        connect timeout to ``operation_timeout``). The pool skips asyncpg's reset of a
        connection on its way back to the pool (a round trip per statement here): the store's
        single statements leave no session state behind.
        """
        _quote_table(table)  # fail on a bad name before connecting
        asyncpg = _asyncpg()
        pool_options.setdefault("min_size", 1)
        pool_options.setdefault("reset", _keep_session)
        if operation_timeout is not None:
            pool_options.setdefault("timeout", operation_timeout)
        try:
            pool = await asyncpg.create_pool(dsn, **pool_options)
        except Exception as exc:
            _raise_store_error(exc, "connect")
        store = cls(pool, table=table, key_prefix=key_prefix, operation_timeout=operation_timeout)
        store._owned_pool = pool
        return store

    @contextlib.asynccontextmanager
    async def _call(self, operation: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._timeout):
                yield
        except Exception as exc:
            _raise_store_error(exc, operation)

    @staticmethod
    def _row_params(storage_key: str, record: IdempotencyRecord, ttl: float) -> tuple[Any, ...]:
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
            datetime.fromtimestamp(record.created_at, UTC),
            datetime.fromtimestamp(record.expires_at, UTC),
            float(ttl),
            _checkpoints_json(record),
        )

    async def create_schema(self) -> bool:
        """Create the table and its expiry index if missing; true when the table was created."""
        async with (
            self._call("create_schema"),
            self._pool.acquire() as connection,
            connection.transaction(),
        ):
            await connection.execute(self._sql["schema_lock"])
            existed = await connection.fetchval(self._sql["table_exists"], self._table)
            await connection.execute(self._schema)
        return not existed

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        params = self._row_params(self._prefix + key, pending, lock_ttl)
        async with self._call("try_acquire"):
            for _ in range(_ACQUIRE_ATTEMPTS):
                if await self._pool.fetchval(self._sql["acquire_insert"], *params):
                    return AcquireResult(acquired=True)
                row = await self._pool.fetchrow(self._sql["acquire_takeover"], *params, recover)
                if row is None:
                    continue  # released in between: insert again
                if row["taken_over"]:
                    return AcquireResult(acquired=True, record=_record_from_row(row))
                if row["live"]:
                    return AcquireResult(acquired=False, record=_record_from_row(row))
        raise StoreError(f"PostgreSQL try_acquire gave up on key {key!r}: it kept changing")

    async def _finish(
        self, operation: str, key: str, record: IdempotencyRecord, ttl: float
    ) -> bool:
        params = self._row_params(self._prefix + key, record, ttl)
        async with self._call(operation):
            written = await self._pool.fetchval(self._sql["finish"], *params)
        return written is not None

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        return await self._finish("complete", key, record, ttl)

    async def fail(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        return await self._finish("fail", key, record, ttl)

    async def save_progress(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        lease = (
            None
            if record.locked_until is None
            else datetime.fromtimestamp(record.locked_until, UTC)
        )
        async with self._call("save_progress"):
            saved = await self._pool.fetchval(
                self._sql["save_progress"],
                self._prefix + key,
                record.owner_token,
                _checkpoints_json(record),
                lease,
                datetime.fromtimestamp(record.expires_at, UTC),
                float(ttl),
            )
        return saved is not None

    async def resolve(
        self, key: str, response: StoredResponse, ttl: float = DEFAULT_RESOLVED_TTL
    ) -> bool:
        """Finish the record under ``key`` with ``response``, whoever holds it."""
        return await resolve_record(self, key, response, ttl)

    async def release(self, key: str, owner_token: str) -> bool:
        async with self._call("release"):
            released = await self._pool.fetchval(
                self._sql["release"], self._prefix + key, owner_token
            )
        return bool(released)

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        async with self._call("renew"):
            renewed = await self._pool.fetchval(
                self._sql["renew"], self._prefix + key, owner_token, float(lock_ttl)
            )
        return renewed is not None

    async def get(self, key: str) -> IdempotencyRecord | None:
        async with self._call("get"):
            row = await self._pool.fetchrow(self._sql["get"], self._prefix + key)
        return None if row is None else _record_from_row(row)

    async def purge_expired(self, batch_size: int = 1000) -> int:
        """Delete expired rows, ``batch_size`` per statement, until a batch comes back short;
        returns how many were deleted. Each batch is its own short transaction that skips rows
        locked by a concurrent takeover, so live keys are never touched or blocked."""
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be at least 1, not {batch_size}")
        total = 0
        while True:
            async with self._call("purge_expired"):
                deleted: int = await self._pool.fetchval(self._sql["purge_batch"], batch_size)
            total += deleted
            if deleted < batch_size:
                return total

    async def aclose(self) -> None:
        """Close the pool :meth:`connect` opened; a pool passed in stays open."""
        pool, self._owned_pool = self._owned_pool, None
        if pool is not None:
            await pool.close()

    async def __aenter__(self) -> PostgresStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
