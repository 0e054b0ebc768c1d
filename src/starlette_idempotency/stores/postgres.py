"""PostgreSQL store: one row per key, INSERT-first ownership, every later write fenced by SQL.

Needs the ``postgres`` extra (asyncpg): ``pip install 'starlette-idempotency[postgres]'``.

Statements per operation (each one statement, so its own short transaction):

* ``try_acquire``: 1 on a free key (``INSERT ... ON CONFLICT DO NOTHING``); 2 when a row is
  there (then one statement takes an expired row over, returning its old values, or reads the
  live holder). It starts again, a few times at most, only when the row changes in between.
  An acquire its caller abandoned (cancelled by the middleware's deadline, timed out, or cut
  off with its connection) is undone in the background by a statement fenced by its owner
  token (see :meth:`PostgresStore._undo_abandoned`), so that no lock outlives a request that
  never ran.
* ``finish``: 1, which locks the row, then writes it fenced by the owner token and says how.
* ``save_progress`` / ``release`` / ``renew`` / ``get``: 1 each, no read first.
* ``purge_expired``: 1 per batch, and 1 for the lapsed operation claims.
* ``claim_operation``: 2 (write, then check; see ``queries.sql``); ``release_operation``: 1.

A pooled connection is looked at before a statement goes out on it: one the server ended while
it sat idle (asyncpg closed it, or something waits to be read on it: the end of the connection,
which the event loop has not read yet because it was busy) is closed instead, with nothing
sent. One whose termination notice the loop has read, but not yet its end, looks alive: asyncpg
refuses to send on it and aborts it. An operation (``create_schema`` excepted) is sent once
more, on a new connection, when its first try certainly had no effect: those, or the server had
ended the connection and said so before answering (``pg_terminate_backend``, a clean restart
or switchover, ``idle_session_timeout``; see :func:`never_ran`). The pool is then told to
replace its other connections too, which usually ended the same way. A connection lost with no
such word after the statement went out is an error, never retried.

Expiry, locks and leases are decided by the database clock (``now()`` plus the duration
argument), so pods with skewed clocks agree. The record's own ``created_at`` and ``expires_at``
are stored and returned as the middleware set them, as data only. Expired rows are invisible at
once and deleted by :meth:`PostgresStore.purge_expired` (run it from cron:
``starlette-idempotency purge``).

The statements are written for READ COMMITTED (a row lock waits for a concurrent writer and
then reads its committed version): under REPEATABLE READ or SERIALIZABLE they would fail with
serialization errors instead. When the database's default isolation is another, the store runs
each statement in an explicit READ COMMITTED transaction (two more round trips, and a warning
once).

Behind PgBouncer in transaction pooling mode, create the pool with
``statement_cache_size=0`` (asyncpg's named prepared statements do not survive a change of
server connection); nothing else in the store depends on session state.

The pool is the app's (passed in, or handed over with ``use_pool``) or the store's own
(``from_dsn``), which it opens on first use in the running event loop and closes in ``aclose``
(see :mod:`._lazy_pool`); nothing in the statements depends on which.

The rooms: this module holds the store's operations and when each may be sent again;
``_postgres_sql.py`` the statements, their parameters and rows read back as records;
``_postgres_connections.py`` what a driver's failure says about a statement, and where a pool
connects; ``_postgres_check.py`` what the startup check reads off the database. A retry is safe
only for statements shaped as ``queries.sql``'s are: read the three together when changing
one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
)
from starlette_idempotency.errors import ConfigurationError, StoreError
from starlette_idempotency.stores._lazy_pool import LazyPool
from starlette_idempotency.stores._postgres_check import (
    CLAIMS_RIGHTS,
    COLUMNS,
    claims_grant,
    claims_table_needed,
    findings,
    insufficient_privilege,
    undefined_table,
)
from starlette_idempotency.stores._postgres_connections import (
    EndedWhileIdle,
    PoolLike,
    create_pool,
    ended_while_idle,
    is_open,
    keep_session,
    location_of,
    may_have_run,
    never_ran,
    pool_location,
    raise_store_error,
)
from starlette_idempotency.stores._postgres_sql import (
    DEFAULT_TABLE,
    Statement,
    TableQueries,
    record_from_row,
    row_params,
    schema_sql,
    shown,
)
from starlette_idempotency.stores._round_trip import ROUND_TRIP_TIMEOUT_SECONDS, RoundTrip
from starlette_idempotency.stores.base import (
    DEFAULT_KEY_PREFIX,
    TAKING_BACK,
    AcquireResult,
    FencedWrite,
    HeldRecord,
    StoreBase,
    StoreFinding,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_OPERATION_TIMEOUT", "DEFAULT_TABLE", "PostgresStore", "schema_sql"]

_T = TypeVar("_T")

DEFAULT_OPERATION_TIMEOUT = 10.0

# A row can change between the two statements of try_acquire (released, or taken over and
# finished); then it starts again. Running out of attempts needs sustained churn on one key.
_ACQUIRE_ATTEMPTS = 5
# The first pause on a takeable row another transaction has locked, doubled at each attempt
# (150 ms in all before it is taken for a fenced transaction's).
_BUSY_PAUSE_SECONDS = 0.01
# The pause between looks at an expired outcome another transaction has locked (a purge's).
_EXPIRED_BUSY_PAUSE_SECONDS = 0.04

# How long the undo of an abandoned acquire waits before trying again while the database fails.
_UNDO_RETRY_SECONDS = 0.1


class PostgresStore(StoreBase):
    """Idempotency records in one PostgreSQL table, shared by every process that uses it.

    Three ways to give it its connections:

    * ``PostgresStore.from_dsn(dsn)`` (at import time): the store opens an asyncpg pool of its
      own on first use, in the running event loop, and :meth:`aclose` closes it (the
      middleware does when the app's lifespan ends). ``await PostgresStore.connect(dsn)`` is
      the same, opened at once.
    * ``PostgresStore(pool)``: your pool, which stays yours (:meth:`aclose` leaves it open).
    * ``PostgresStore()`` (at import time), then :meth:`use_pool` in your lifespan: your pool,
      opened in your lifespan, handed over before the app serves.

    Call :meth:`create_schema` once (or run ``starlette-idempotency migrate``) before use.
    ``operation_timeout`` (seconds) bounds each operation, the wait for a pooled connection
    and its one retry included; past it the operation raises
    :class:`~starlette_idempotency.errors.StoreTimeoutError`. ``None`` waits forever.
    """

    name = "postgres"
    supports_recovery = True

    def __init__(
        self,
        pool: PoolLike | None = None,
        *,
        table: str = DEFAULT_TABLE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
    ) -> None:
        #: The pool passed in or handed over (``use_pool``); ``None`` while there is none.
        self._pool = pool
        #: A pool of the store's own (``from_dsn``): its DSN and options, and the pool itself,
        #: opened on first use in the running event loop.
        self._dsn: str | None = None
        self._pool_options: dict[str, Any] = {}
        self._own_pool: LazyPool[Any] | None = None
        self._table_name = table
        #: The store's statements (also run in the app's transaction: ``_transaction``).
        self.queries = queries = TableQueries(table, key_prefix)
        self._table = queries.table
        self._location = None if pool is None else pool_location(pool)
        self._prefix = queries.prefix
        self._timeout = operation_timeout
        self._sql = queries.sql
        self._schema = schema_sql(table)
        # Whether statements need an explicit READ COMMITTED transaction (None: not known yet).
        self._explicit_isolation: bool | None = None
        self._undoing: set[asyncio.Task[None]] = set()
        claims_table = shown(queries.operations)
        self._round_trip = RoundTrip(
            self,
            f"Grant the store's role SELECT, INSERT, UPDATE and DELETE on {table} and "
            f"{claims_table}, and give the table the shape `starlette-idempotency migrate "
            "--sql` prints (its primary key, its column types)",
            ROUND_TRIP_TIMEOUT_SECONDS,
        )

    @classmethod
    def from_dsn(
        cls,
        dsn: str | None,
        *,
        table: str = DEFAULT_TABLE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
        **pool_options: Any,
    ) -> PostgresStore:
        """A store with an asyncpg pool of its own on ``dsn``, opened on first use.

        Nothing connects here, so the store can be built at import time (``uvicorn
        main:app``): the pool is opened by the first operation, in the running event loop,
        once however many requests arrive together; with the middleware, that is its startup
        check, in the server's loop. :meth:`aclose` closes it, and the middleware calls it
        when the app's lifespan ends; that event loop then gets no other until the app starts
        again (:meth:`reopen`). A later event loop opens a new one (a test client that starts
        the app again runs it in a loop of its own).

        ``pool_options`` go to ``asyncpg.create_pool`` (``min_size`` defaults to 1, and the
        connect timeout to ``operation_timeout``); ``dsn`` may be ``None`` to connect as the
        libpq environment (``PGHOST``...) says. The pool skips asyncpg's reset of a
        connection on its way back to the pool (a round trip per statement here): the store's
        single statements leave no session state behind.
        """
        store = cls(table=table, key_prefix=key_prefix, operation_timeout=operation_timeout)
        pool_options.setdefault("min_size", 1)
        pool_options.setdefault("reset", keep_session)
        if operation_timeout is not None:
            pool_options.setdefault("timeout", operation_timeout)
        store._dsn, store._pool_options = dsn, pool_options
        store._own_pool = LazyPool(
            lambda: create_pool(dsn, pool_options), name="PostgresStore's own pool"
        )
        store._location = location_of(dsn, pool_options)
        return store

    @classmethod
    async def connect(
        cls,
        dsn: str | None,
        *,
        table: str = DEFAULT_TABLE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        operation_timeout: float | None = DEFAULT_OPERATION_TIMEOUT,
        **pool_options: Any,
    ) -> PostgresStore:
        """:meth:`from_dsn`, its pool opened now: a database it cannot reach raises here."""
        store = cls.from_dsn(
            dsn,
            table=table,
            key_prefix=key_prefix,
            operation_timeout=operation_timeout,
            **pool_options,
        )
        await store._current_pool()
        return store

    def use_pool(self, pool: PoolLike) -> None:
        """Hand the store the pool your app opened, in its lifespan before it yields: the
        store uses it from then on, and leaves it to you to close.

        For a store built without a pool (``PostgresStore(table=...)``). A second pool is
        refused while the first is open; once your lifespan closed it, a new lifespan (a test
        client that starts the app again) hands over its own.
        """
        if self._own_pool is not None:
            raise ConfigurationError(
                "this PostgresStore opens a pool of its own (PostgresStore.from_dsn or "
                "connect): to hand it yours, build it as PostgresStore(table=...) instead"
            )
        if self._pool is not None and self._pool is not pool and is_open(self._pool):
            raise ConfigurationError(
                "this PostgresStore already uses a pool, which is still open: hand it one "
                "pool (use_pool once per lifespan, after the previous lifespan closed its pool)"
            )
        if pool is not self._pool:  # another pool may reach another database, as another role
            self._round_trip.worked = False
        self._pool = pool
        self._location = pool_location(pool)

    @property
    def owns_connections(self) -> bool:
        """Whether the store opened its pool itself (``from_dsn``, ``connect``): the
        middleware then closes it when the app's lifespan ends."""
        return self._own_pool is not None

    def reopen(self) -> None:
        """Let a store closed by :meth:`aclose` open its own pool again, on first use: the
        middleware calls it when the app starts again in the same event loop."""
        if self._own_pool is not None:
            self._own_pool.reopen()

    async def _current_pool(self) -> Any:
        """The pool to use now: the store's own (opened if need be), or the one passed in."""
        if self._own_pool is not None:
            return await self._own_pool.get()
        if self._pool is None:
            raise ConfigurationError(
                f"PostgresStore (table {self._table_name}) has no pool: hand it the pool your "
                "app opens with store.use_pool(pool) in your lifespan, before it yields, or "
                "build it with PostgresStore.from_dsn(dsn) to let it open its own"
            )
        return self._pool

    async def _run(
        self, operation: str, attempt: Callable[[], Awaitable[_T]], *, retry: bool = True
    ) -> _T:
        """Run ``attempt`` within the operation timeout, driver errors mapped; once more, on a
        new connection, when the first try certainly had no effect (see :func:`never_ran`).

        Each statement of ``attempt`` must be its own transaction, and ``attempt`` safe to
        start again after its earlier statements ran (they only read or fail to write).
        """
        try:
            async with asyncio.timeout(self._timeout):
                try:
                    return await attempt()
                except Exception as exc:
                    if not (retry and never_ran(exc)):
                        raise
                    logger.warning(
                        "PostgreSQL %s: the server had closed the connection (%s); "
                        "running it again on a new connection",
                        operation,
                        exc,
                    )
                    # A restart, failover or timeout that ended this connection ended the
                    # pool's others too: have them all replaced rather than tried one by one.
                    await (await self._current_pool()).expire_connections()
                    return await attempt()
        except Exception as exc:
            # A database that failed a request (a standby after a failover, a revoked grant)
            # is not ready until the check's round trip works again.
            self._round_trip.failed(operation)
            raise_store_error(exc, operation)

    def _fetchval(self, operation: str, query: str, *args: Any) -> Awaitable[Any]:
        """The first value of the named ``query``, run as ``operation`` (see :meth:`_run`)."""
        return self._run(operation, lambda: self._value(query, *args))

    def _execute(self, operation: str, statement: Statement) -> Awaitable[Any]:
        """The first value of ``statement``, run as ``operation`` (see :meth:`_run`)."""
        return self._fetchval(operation, statement.query, *statement.args)

    def _fetchrow(self, operation: str, query: str, *args: Any) -> Awaitable[Any]:
        """The first row of the named ``query``, run as ``operation`` (see :meth:`_run`)."""
        return self._run(operation, lambda: self._row(query, *args))

    def _value(self, query: str, *args: Any) -> Awaitable[Any]:
        """The first value of the named ``query``, run once (see :meth:`_statement`)."""
        sql = self._sql[query]
        return self._statement(lambda on: on.fetchval(sql, *args))

    def _row(self, query: str, *args: Any) -> Awaitable[Any]:
        """The first row of the named ``query``, run once (see :meth:`_statement`)."""
        sql = self._sql[query]
        return self._statement(lambda on: on.fetchrow(sql, *args))

    async def _statement(self, run: Callable[[Any], Awaitable[_T]]) -> _T:
        """``run`` one statement on a pooled connection as its own transaction, at READ
        COMMITTED: in an explicit transaction when the database's default isolation is another.

        A connection the server ended while it sat idle is never used (see
        :class:`EndedWhileIdle`)."""
        pool = await self._current_pool()
        async with pool.acquire() as connection:
            if ended_while_idle(connection):
                connection.terminate()
                raise EndedWhileIdle("the server had ended the pooled connection while idle")
            if self._explicit_isolation is None:
                await self._learn_isolation(connection)
            if not self._explicit_isolation:
                return await run(connection)
            failed: Exception | None = None
            try:
                async with connection.transaction(isolation="read_committed"):
                    try:
                        return await run(connection)
                    except Exception as exc:
                        failed = exc
                        raise
            except Exception as exc:
                if failed is None or exc is failed:
                    raise
                raise failed from exc  # the rollback failed too (the connection is gone)

    async def _learn_isolation(self, connection: Any) -> None:
        isolation = await connection.fetchval(self._sql["default_isolation"])
        self._explicit_isolation = isolation != "read committed"
        if self._explicit_isolation:
            logger.warning(
                "PostgreSQL's default_transaction_isolation is %r: the store runs each statement "
                "in an explicit READ COMMITTED transaction (two more round trips). Set "
                "default_transaction_isolation = 'read committed' for the store's role "
                "(ALTER ROLE ... SET) or its pool (server_settings) to save them",
                isolation,
            )

    async def create_schema(self) -> bool:
        """Create the table and its expiry index if missing; true when the table was created."""

        async def create() -> bool:
            pool = await self._current_pool()
            async with pool.acquire() as connection, connection.transaction():
                await connection.execute(self._sql["schema_lock"])
                existed = await connection.fetchval(self._sql["table_exists"], self._table)
                await connection.execute(self._schema)
            return not existed

        # Several statements and an explicit COMMIT: never_ran's reasoning covers single
        # statements only, so this is not retried (it is run once, at deploy time).
        return await self._run("create_schema", create, retry=False)

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        """Write ``pending`` if the key is free (see the protocol); a live ``InProgress`` row
        that already holds ``pending``'s owner token counts as acquired (the engine taking its
        key back), with ``record`` that row only when it carries checkpoints."""
        params = row_params(self._prefix + key, pending, lock_ttl)

        async def acquire() -> AcquireResult | None:
            for attempt in range(_ACQUIRE_ATTEMPTS):
                if await self._value("acquire_insert", *params):
                    return AcquireResult(acquired=True)
                row = await self._row("acquire_takeover", *params, recover)
                while (
                    row is not None
                    and row["busy"]
                    and not row["live"]
                    and row["status"] != RecordStatus.IN_PROGRESS
                ):
                    # An expired outcome, yet locked: by a purge deleting it (for as long as its
                    # batch takes) or a taker's statement, never by a fence (which holds a
                    # running request's row). It answers nothing: wait for its lock to end,
                    # within the operation's timeout.
                    await asyncio.sleep(_EXPIRED_BUSY_PAUSE_SECONDS)
                    row = await self._row("acquire_takeover", *params, recover)
                if row is not None and row["busy"]:
                    if attempt + 1 < _ACQUIRE_ATTEMPTS:
                        # A statement's lock lasts a moment: then the row is the taker's or
                        # finished, and judged as it is.
                        await asyncio.sleep(_BUSY_PAUSE_SECONDS * 2**attempt)
                        continue
                    if row["status"] == RecordStatus.IN_PROGRESS:
                        # Locked all this time: by the app's transaction that fenced it
                        # (idempotency_transaction), whose handler is running.
                        return AcquireResult(
                            acquired=False, record=record_from_row(row), lease_expired=False
                        )
                if row is None or not row["live"]:
                    continue  # released or changed in between: insert again
                found = record_from_row(row)
                if (
                    found.owner_token == pending.owner_token
                    and found.status is RecordStatus.IN_PROGRESS
                ):  # a finished record is an answer, not a lock its owner still holds
                    return AcquireResult(acquired=True, record=found if found.checkpoints else None)
                if row["taken_over"]:
                    return AcquireResult(acquired=True, record=found)
                return AcquireResult(
                    acquired=False, record=found, lease_expired=row["lease_expired"]
                )
            return None

        try:
            result = await self._run("try_acquire", acquire)
        except asyncio.CancelledError:
            self._undo_abandoned(key, pending.owner_token, params, lock_ttl)
            raise
        except StoreError as exc:
            if may_have_run(exc.__cause__):
                self._undo_abandoned(key, pending.owner_token, params, lock_ttl)
            raise
        if result is None:
            raise StoreError(f"PostgreSQL try_acquire gave up on key {key!r}: it kept changing")
        return result

    def _undo_abandoned(
        self, key: str, owner_token: str, params: tuple[Any, ...], lock_ttl: float
    ) -> None:
        """Undo an acquire whose caller gave up (cancelled by the middleware's deadline, timed
        out, or its connection lost with no word from the server): the caller will not run the
        handler, so its lock must not answer retries 409 for ``lock_ttl``.

        Its last statement may have committed just as the deadline fired; by the time the
        cancellation reaches the caller asyncpg has waited for the server to finish that
        statement, so the undo (``abandon`` in ``queries.sql``, fenced by the acquire's owner
        token) runs after it, deletes the row, or ends the lease of a recovery takeover, and
        leaves an expired row that makes an insert landing even later write nothing. It is
        sent in the background and tried again until ``lock_ttl`` has passed.
        """
        if TAKING_BACK.get() == owner_token:  # its handler runs (see stores.base.take_back)
            return
        task = asyncio.get_running_loop().create_task(self._undo(key, params, lock_ttl))
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _undo(self, key: str, params: tuple[Any, ...], lock_ttl: float) -> None:
        failure: StoreError | None = None
        try:
            async with asyncio.timeout(lock_ttl):  # by then the abandoned lock has lapsed
                while True:
                    try:
                        await self._fetchval("undo (abandon)", "abandon", *params)
                        return
                    except StoreError as exc:
                        failure = exc
                        await asyncio.sleep(_UNDO_RETRY_SECONDS)
        except TimeoutError:
            logger.warning(
                "could not undo the abandoned acquire of %r before its lock lapsed: %s",
                key,
                failure,
            )

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        return FencedWrite(await self._execute("finish", self.queries.finish(key, record, ttl)))

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        statement = self.queries.save_progress(key, record, ttl, lease, fenced=False)
        return await self._execute("save_progress", statement) is not None

    async def release(self, key: str, owner_token: str) -> bool:
        released = await self._fetchval("release", "release", self._prefix + key, owner_token)
        return bool(released)

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        """Extend the lock to ``lock_ttl`` from now on the database clock; for a record with
        recovery points, its lease, the row then kept at least to the lease's end (or ``ttl``
        from now, when given)."""
        retention = None if ttl is None else float(ttl)
        renewed = await self._fetchval(
            "renew", "renew", self._prefix + key, owner_token, float(lock_ttl), retention
        )
        return renewed is not None

    async def get(self, key: str) -> IdempotencyRecord | None:
        row = await self._fetchrow("get", "get", self._prefix + key)
        return None if row is None else record_from_row(row)

    async def purge_expired(self, batch_size: int = 1000) -> int:
        """Delete expired rows, ``batch_size`` per statement, until a batch comes back short;
        returns how many were deleted. Each batch is its own short transaction that skips rows
        locked by a concurrent takeover, so live keys are never touched or blocked.

        The lapsed operation claims go first, in one statement, not counted (a table of claims
        that a database migrated before 0.3 lacks is skipped, as is one the role may not use,
        with a warning saying what to grant: the expired records are purged all the same)."""
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be at least 1, not {batch_size}")
        try:
            await self._fetchval("purge_expired", "purge_claims")
        except StoreError as exc:
            if insufficient_privilege(exc):
                logger.warning(
                    "could not delete the lapsed operation claims (%s); purging the expired "
                    "records all the same. Run %s",
                    exc,
                    claims_grant(self.queries.operations, "<the store's role>"),
                )
            elif not undefined_table(exc):
                raise
        total = 0
        while True:
            deleted: int = await self._fetchval("purge_expired", "purge_batch", batch_size)
            total += deleted
            if deleted < batch_size:
                return total

    async def claim_operation(
        self, operation: str, code: str, holder: str, ttl: float
    ) -> str | None:
        """Claim ``operation`` for ``holder`` (see ``OperationClaimingStore``): a row of
        ``<table>_operations``, its expiry on the database clock. Two statements, write then
        check (``claim_write``, ``claim_check``), both safe to send again.

        Raises :class:`StoreError` when the table of claims does not exist yet (a schema made
        before claims existed), saying how to create it."""
        args = (self._prefix + operation, holder, code)

        async def claim() -> str | None:
            await self._value("claim_write", *args, float(ttl))
            other: str | None = await self._value("claim_check", *args)
            return other

        with claims_table_needed(self.queries.operations, self._location):
            return await self._run("claim_operation", claim)

    async def release_operation(self, operation: str, holder: str) -> None:
        """End ``holder``'s claim on ``operation``."""
        with claims_table_needed(self.queries.operations, self._location):
            await self._fetchval("release_operation", "unclaim", self._prefix + operation, holder)

    def describe(self) -> str:
        """Where the store is, for messages: ``postgres at host:port/db table name``."""
        if self._location is None:
            return f"postgres (no pool handed over yet) table {self._table_name}"
        return f"postgres at {self._location} table {self._table_name}"

    async def check(self) -> list[StoreFinding]:
        """Reach the database and report what would break or weaken the store: an ``error``
        when it is unreachable, read-only, or the table is missing or incomplete; a
        ``warning`` when a crash can lose acknowledged records, or when the table of operation
        claims is missing or the role lacks a right on it (the app starts, and claims
        nothing). Never raises a store error; raises :class:`ConfigurationError` for a store
        that cannot work as it is configured (no pool handed over, pool options asyncpg
        refuses), which refuses the app's startup.

        With the middleware it is the store's first operation unless the app's own startup
        used the store: a store built by :meth:`from_dsn` then opens its pool here, in the
        server's event loop."""
        try:
            row = await self._fetchrow(
                "check", "check", self._table, COLUMNS, self.queries.operations, CLAIMS_RIGHTS
            )
        except StoreError as exc:
            return [StoreFinding("error", f"{self.describe()} is unreachable: {exc}")]
        found = findings(
            row,
            table=self._table_name,
            claims_table=self.queries.operations,
            location=self._location,
        )
        if any(finding.level == "error" for finding in found):
            return found
        refused = await self._round_trip.finding(self.describe())
        return found if refused is None else [refused, *found]

    async def in_progress(self, *, stuck: bool = False, limit: int = 1000) -> list[HeldRecord]:
        """Live ``InProgress`` records under the store's prefix, oldest first, at most ``limit``
        (for operators: ``starlette-idempotency list``; read-only). With ``stuck``, only those
        whose lease ran out (:attr:`HeldRecord.lease_expired`), judged on the database clock.
        A query of ``sql/operator.sql`` that scans the table."""
        sql = self._sql["in_progress"]

        def fetch() -> Awaitable[list[Any]]:
            return self._statement(lambda on: on.fetch(sql, stuck, limit, self._prefix))

        rows = await self._run("in_progress", fetch)
        return [
            HeldRecord(row["key"][len(self._prefix) :], record_from_row(row), row["lease_expired"])
            for row in rows
        ]

    async def aclose(self) -> None:
        """Close the pool the store opened itself (:meth:`from_dsn`, :meth:`connect`), after
        which it opens no other in this event loop (until :meth:`reopen`); a pool passed in
        stays open, and the store usable with it."""
        undoing = list(self._undoing)  # undoing abandoned acquires is best effort
        for task in undoing:
            task.cancel()
        await asyncio.gather(*undoing, return_exceptions=True)
        if self._own_pool is not None:
            try:
                await self._own_pool.close()
            except Exception as exc:
                raise_store_error(exc, "close")

    async def __aenter__(self) -> PostgresStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
