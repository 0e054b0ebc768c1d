"""The outcome in the app's own transaction: :func:`idempotency_transaction`.

A lock held by renewals keeps a retry out only while the lease lasts; a frozen process, a long
collector pause or a crash right after the app's commit outlast it. What keeps a payment once
whatever the lease does is the database: the handler's rows, its recovery points and its
``Completed`` record commit in one transaction, on the app's connection, and that transaction
first locks the record's row under this request's owner token.

* Fenced: the first statement (``fence``) locks the row while it is ``InProgress`` and this
  request's. A request whose key was taken over gets :class:`LockLostError` before it writes,
  and its transaction is rolled back; a retry that comes while it is open is answered 409 (the
  row is locked, not written, so nothing waits for it), and one after it finds it finished.
  Nothing here depends on the isolation level: the row lock is the fence.
* One outcome: ``tx.respond(response)`` writes the finished record in the transaction; once it
  commits, the middleware writes nothing more for the request (a crash after the commit leaves
  the record finished, and the retry is replayed).

The statements are the store's own (``stores/_postgres_sql``), run on the app's connection: an
asyncpg ``Connection``, or SQLAlchemy's ``AsyncConnection`` or ``AsyncSession`` on the asyncpg
driver.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from types import TracebackType
from typing import Any, Protocol

from starlette.requests import HTTPConnection
from starlette.responses import Response

from starlette_idempotency._endpoint import key_owner
from starlette_idempotency._lease import Lease
from starlette_idempotency._record import IdempotencyRecord, RecordStatus
from starlette_idempotency.errors import ConfigurationError, IdempotencyError, LockLostError
from starlette_idempotency.stores._postgres_sql import Statement, TableQueries

__all__ = ["IdempotencyTransaction", "idempotency_transaction"]

logger = logging.getLogger(__name__)


class _Connection(Protocol):
    """The app's connection, as the transaction uses it."""

    def in_transaction(self) -> bool: ...

    def in_savepoint(self) -> bool: ...

    def ended_by_app(self) -> bool: ...

    async def begin(self) -> None: ...

    def join(self) -> None: ...

    async def flush(self) -> None: ...

    async def commit(self) -> None: ...

    async def rollback(self) -> None: ...

    async def fetchval(self, sql: str, args: tuple[Any, ...]) -> Any: ...


class _Opened:
    """A driver's connection, and the transaction opened or joined on it."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._transaction: Any = None

    def join(self) -> None:
        """Take the transaction open on the connection as the block's, to tell whether the
        app ends it inside the block."""

    async def flush(self) -> None:
        """Send what the driver holds back until the commit (a session's pending ORM writes):
        a failure then commits nothing."""

    async def commit(self) -> None:
        await self._transaction.commit()

    async def rollback(self) -> None:
        await self._transaction.rollback()


class _Asyncpg(_Opened):
    """An asyncpg ``Connection``."""

    def in_transaction(self) -> bool:
        return bool(self._connection.is_in_transaction())

    def in_savepoint(self) -> bool:
        return False  # asyncpg tells no one: the docs ask not to join inside a savepoint

    def ended_by_app(self) -> bool:
        connection = self._connection
        return not connection.is_closed() and not connection.is_in_transaction()

    async def rollback(self) -> None:
        if not self._connection.is_closed():  # else the server rolled back as it ended
            await self._transaction.rollback()

    async def begin(self) -> None:
        self._transaction = self._connection.transaction()
        await self._transaction.start()

    async def fetchval(self, sql: str, args: tuple[Any, ...]) -> Any:
        return await self._connection.fetchval(sql, *args)


class _SQLAlchemy(_Opened):
    """A SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` (asyncpg driver): statements go
    through SQLAlchemy, so that they run in the transaction it began."""

    def in_transaction(self) -> bool:
        return bool(self._connection.in_transaction())

    def in_savepoint(self) -> bool:
        return bool(self._connection.in_nested_transaction())

    def ended_by_app(self) -> bool:
        # A failed flush deactivates a session's transaction without ending it: still ours.
        return self._connection.get_transaction() is not self._transaction

    async def begin(self) -> None:
        self._transaction = await self._connection.begin()

    def join(self) -> None:
        self._transaction = self._connection.get_transaction()

    async def flush(self) -> None:
        if hasattr(self._connection, "flush"):  # an AsyncSession
            await self._connection.flush()

    async def fetchval(self, sql: str, args: tuple[Any, ...]) -> Any:
        connection = self._connection
        if hasattr(connection, "exec_driver_sql"):
            result = await connection.exec_driver_sql(sql, args)
        else:  # an AsyncSession: the connection of its transaction
            result = await (await connection.connection()).exec_driver_sql(sql, args)
        return result.scalar()


_UNDEFINED_TABLE = "42P01"


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver's error: asyncpg's, or SQLAlchemy's wrapping it."""
    for error in (exc, getattr(exc, "orig", None), exc.__cause__):
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate
    return None


#: SQLSTATEs that do not say the server rolled the transaction back: the connection lost
#: (class ``08``: asyncpg raises it for a connection closed mid-statement), the server shut
#: down or the backend terminated (``57P``; a cancelled statement, ``57014``, did roll back),
#: an internal error (class ``XX``).
_IN_DOUBT_CLASSES = ("08", "57P", "XX")


def _commit_in_doubt(exc: BaseException) -> bool:
    """Whether a commit that raised ``exc`` may have committed: any failure but the server's
    refusal (a serialization failure, a deferred constraint), which rolled it back."""
    sqlstate = _sqlstate(exc)
    return sqlstate is None or sqlstate.startswith(_IN_DOUBT_CLASSES)


def _adapt(connection: object) -> _Connection:
    module = type(connection).__module__
    if module.startswith("asyncpg"):
        return _Asyncpg(connection)
    if module.startswith("sqlalchemy"):
        bind = getattr(connection, "bind", None)  # an AsyncSession's engine or connection
        dialect = getattr(connection if bind is None else bind, "dialect", None)
        driver = getattr(dialect, "driver", None)
        if driver != "asyncpg":
            raise ConfigurationError(
                "idempotency_transaction needs SQLAlchemy's asyncpg driver "
                f"(postgresql+asyncpg://...), not {driver or 'an unbound session'}: its "
                "statements use asyncpg's $1 parameters"
            )
        return _SQLAlchemy(connection)
    raise ConfigurationError(
        "idempotency_transaction takes the app's connection to the database of its "
        "PostgresStore: an asyncpg Connection, or a SQLAlchemy AsyncConnection or "
        f"AsyncSession on the asyncpg driver, not {type(connection).__name__}"
    )


class IdempotencyTransaction:
    """``tx`` of ``async with idempotency_transaction(request, connection) as tx``: the
    request's record, written in the app's transaction."""

    __slots__ = ("_connection", "_lease", "_opened", "_queries", "_record", "_responded")

    def __init__(self, lease: Lease, connection: _Connection, queries: TableQueries) -> None:
        self._lease = lease
        self._connection = connection
        self._queries = queries
        self._opened = False
        #: The record as the transaction has written it (committed with it).
        self._record: IdempotencyRecord | None = None
        self._responded: tuple[int, bytes] | None = None

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """Write a recovery point (JSON-serialisable ``data``) in the transaction: it commits
        with the handler's own writes, or not at all."""
        self._usable(f"checkpoint({name!r})")
        record = self._lease.with_checkpoint(self._record or self._lease.record, name, data)
        await self._save(record)
        self._record = record

    async def _restamp_lease(self) -> None:
        """The lease a recovery point set runs from its statement: saved again as the block
        ends, it runs from the commit (or the block's end), however long the block went on."""
        if self._responded is None and self._record is not None:
            await self._save(self._record)

    async def _save(self, record: IdempotencyRecord) -> None:
        """Write ``record``'s recovery points, with a lease of ``lock_ttl_seconds`` from now."""
        lease = self._lease
        policy = lease.policy
        statement = self._queries.save_progress(
            lease.store_key, record, policy.ttl_seconds, policy.lock_ttl_seconds, fenced=True
        )
        if await self._run(statement) is None:  # the row is locked and ours: cannot happen
            raise LockLostError(f"the record of idempotency key {lease.key!r} changed")

    async def respond(self, response: Response) -> Response:
        """Write ``response`` as the request's outcome in the transaction, and return it for
        the endpoint to return (unchanged: a response going out that differs is logged as an
        error, and retries get the committed one)."""
        lease = self._lease
        self._usable("respond()")
        body = getattr(response, "body", None)
        if not isinstance(body, bytes):
            raise IdempotencyError(
                f"tx.respond() takes a response with its body in memory (Response, "
                f"JSONResponse...), not {type(response).__name__}: a streamed body cannot be "
                "written in the transaction"
            )
        status = response.status_code
        kept = body if len(body) <= lease.policy.max_response_bytes else None
        outcome = lease.outcome(status, list(response.raw_headers), kept)
        if outcome is None:
            raise IdempotencyError(
                f"tx.respond() got status {status}, which frees the key for a retry instead of "
                "being stored: raise (the transaction rolls back), or return that response "
                "outside the transaction"
            )
        record = outcome[0]
        if self._record is not None:  # with the recovery points written in the transaction
            record = replace(record, checkpoints=self._record.checkpoints)
        await self._run(self._queries.finish(lease.store_key, record, lease.policy.ttl_seconds))
        self._record = record
        self._responded = (status, body)
        return response

    def _usable(self, what: str) -> None:
        if self._responded is not None:
            raise IdempotencyError(f"{what} after tx.respond(): the outcome is written")
        if not self._lease.transaction_open:
            raise IdempotencyError(f"{what} outside its idempotency_transaction block")
        if self._connection.ended_by_app():
            raise self._refuse_the_apps_end()

    def _refuse_the_apps_end(self) -> IdempotencyError:
        """The block's transaction (opened by it, or the app's it joined) was committed or
        rolled back by the app inside it: what it committed is not known here, so nothing
        more is written for the request and its lock lapses (a retry then finds what
        committed)."""
        self._lease.in_doubt = True
        ends = "the block commits it as it ends" if self._opened else "you commit it after"
        return IdempotencyError(
            f"the transaction of the idempotency_transaction block for idempotency key "
            f"{self._lease.key!r} was committed or rolled back inside the block: {ends}, "
            "with the record. Remove the commit() (or rollback()) from the block; the key is "
            "left locked until its lock expires"
        )

    async def _outcome_committed_by_the_app(self) -> bool:
        """Whether the app's commit inside the block, after ``tx.respond()``, committed the
        outcome: the record is finished under this request's owner token. Not when the block
        opened the transaction and the app has begun another since (writes after its commit,
        which nobody would commit: the block's end commits the transaction it opened)."""
        if self._responded is None:
            return False
        if self._opened:
            await self._connection.flush()
            if self._connection.in_transaction():
                return False
        lease = self._lease
        found = await lease.store.get(lease.store_key)
        return (
            found is not None
            and found.owner_token == lease.record.owner_token
            and found.status is not RecordStatus.IN_PROGRESS
        )

    def _refuse_nothing_recorded(self) -> IdempotencyError:
        """The block ends with neither the outcome nor a recovery point written: its writes
        would commit with nothing on the record to say so, and a failure after it (a 500)
        would free the key for a retry that writes them again."""
        undone = "it was rolled back" if self._opened else "roll your transaction back"
        return IdempotencyError(
            f"the idempotency_transaction block for idempotency key {self._lease.key!r} ended "
            "without tx.respond() or tx.checkpoint(): what it wrote would commit with nothing "
            "on the record, and a retry after a failure would write it again. Return "
            f"`await tx.respond(response)` from the block, or save a recovery point with "
            f"tx.checkpoint(name, data) in it ({undone})"
        )

    async def _run(self, statement: Statement) -> Any:
        return await self._connection.fetchval(self._queries.sql[statement.query], statement.args)

    async def __aenter__(self) -> IdempotencyTransaction:
        lease = self._lease
        # A block again after one in a transaction of the app's: the app's retry of that
        # transaction (a serialization failure). Its fence finds whether the first committed.
        again = lease.recorded is not None and lease.in_the_apps_transaction
        if lease.transaction_open or lease.in_doubt or (lease.recorded is not None and not again):
            raise IdempotencyError(
                f"idempotency key {lease.key!r} is already in an idempotency_transaction: "
                "one transaction writes a request's outcome"
            )
        if lease.decided:
            # A background task's, say: the key may be freed already, and a release would
            # then delete what this transaction commits.
            raise IdempotencyError(
                f"idempotency_transaction for idempotency key {lease.key!r} after its "
                "response ended or its key was freed: open it in the endpoint, before it "
                "returns its response"
            )
        connection = self._connection
        if not connection.in_transaction():
            await connection.begin()
            self._opened = True
        elif connection.in_savepoint():
            raise IdempotencyError(
                "idempotency_transaction inside a savepoint (begin_nested()): rolled back to "
                "the savepoint, the record would be undone while the transaction's other "
                "writes commit. Open it in the top-level transaction"
            )
        else:
            connection.join()
        lease.transaction_open = True
        try:
            try:
                fenced = await self._run(
                    self._queries.fence(lease.store_key, lease.record.owner_token)
                )
            except Exception as exc:
                if _sqlstate(exc) == _UNDEFINED_TABLE:
                    raise self._elsewhere() from exc
                raise
            if fenced is None:
                raise await self._lost()
            lease.recorded = None  # still InProgress: what an earlier block wrote rolled back
        except BaseException:
            lease.transaction_open = False
            if self._opened:
                await connection.rollback()
            raise
        return self

    async def _lost(self) -> Exception:
        """Why the fence found no row of this request's: an earlier block finished it (in this
        transaction, or in one of the app's that committed), the key was taken over (or is
        gone), or the connection is not on the store's database."""
        lease = self._lease
        if lease.recorded is not None:  # this transaction's earlier block finished the row
            return IdempotencyError(
                f"idempotency key {lease.key!r} is already in an idempotency_transaction: "
                "one transaction writes a request's outcome"
            )
        found = await lease.store.get(lease.store_key)
        if (
            found is not None
            and found.owner_token == lease.record.owner_token
            and found.status is RecordStatus.IN_PROGRESS
        ):
            return self._elsewhere()
        return LockLostError(
            f"the lock for idempotency key {lease.key!r} was taken over (its lease lapsed) "
            "before the transaction: nothing written in it may commit, and another attempt "
            "owns the key"
        )

    def _elsewhere(self) -> ConfigurationError:
        return ConfigurationError(
            f"the connection given to idempotency_transaction is not on the database of the "
            f"store, whose table {self._queries.table} holds the record: the record, the app's "
            "rows and its outbox commit together only in one database. Give it a connection "
            "to the store's database, or build the store on the app's (PostgresStore(pool))"
        )

    async def _end(self, *, committing: bool) -> None:
        """Commit (or roll back) the transaction this block opened. A commit that ends
        without the server's answer (the connection lost, a cancel, a timeout) may have
        committed: the lease is then left in doubt, so that no release deletes a record that
        did commit. One the server refused rolled back, and one never sent (a session's flush
        failed, a statement in the transaction failed, the connection had closed) committed
        nothing: the key is freed as for any failure."""
        connection = self._connection
        if not committing:
            await connection.rollback()
            return
        try:
            await connection.flush()
            await self._still_committable()
            await self._restamp_lease()
        except BaseException:
            with contextlib.suppress(Exception):  # that failure is the one to raise
                await connection.rollback()
            raise
        try:
            await connection.commit()
        except BaseException as exc:
            if _commit_in_doubt(exc):
                self._lease.in_doubt = True
            raise

    async def _still_committable(self) -> None:
        """Raise unless the transaction can still commit. A statement that failed in it, its
        error caught by the app, leaves it aborted, and PostgreSQL answers its COMMIT with a
        ROLLBACK that no driver raises: this fails instead (25P02), as it does on a
        connection closed already."""
        await self._connection.fetchval("SELECT 1", ())

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        lease = self._lease
        commit_seen = self._opened  # else the app's transaction commits it after the block
        try:
            if self._connection.ended_by_app():
                if kind is None and await self._outcome_committed_by_the_app():
                    commit_seen = True
                else:
                    error = self._refuse_the_apps_end()
                    if kind is None:
                        raise error
                    logger.error("%s", error)  # the block's own exception goes on
            elif kind is None and self._responded is None and self._record is None:
                if self._opened:
                    await self._end(committing=False)
                raise self._refuse_nothing_recorded()
            elif self._opened:
                await self._end(committing=kind is None)
            elif kind is None:  # the app's transaction commits the outcome: if it still can
                await self._still_committable()
                await self._restamp_lease()
        finally:
            lease.transaction_open = False
        if kind is not None:
            return
        # Committed (or, in a transaction of the app's, to commit with it): what the lease
        # writes from now on builds on it, and an outcome is never written again.
        if self._responded is not None:
            lease.recorded = self._responded
            lease.in_the_apps_transaction = not commit_seen
        elif self._record is not None:
            lease.record = self._record


def idempotency_transaction(request: HTTPConnection, connection: Any) -> IdempotencyTransaction:
    """Write the request's idempotency record in the app's own transaction on ``connection``
    (an asyncpg ``Connection``, a SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` on the
    asyncpg driver), with the handler's rows and outbox::

        async with idempotency_transaction(request, connection) as tx:
            await connection.execute("INSERT INTO payments ...")
            return await tx.respond(JSONResponse(payment, status_code=201))

    It joins the transaction open on ``connection`` or opens one (committed or rolled back as
    the block ends). Entering locks the record's row, which must be ``InProgress`` and this
    request's: otherwise :class:`~starlette_idempotency.errors.LockLostError` is raised and
    nothing written in the transaction commits. ``tx.checkpoint(name, data)`` writes a
    recovery point, ``tx.respond(response)`` the outcome, both in the transaction.

    Needs a ``PostgresStore`` on the same database as ``connection``.
    """
    lease = key_owner(request)
    assert isinstance(lease, Lease)
    store = lease.store
    queries = getattr(store, "queries", None)
    if not isinstance(queries, TableQueries):
        raise ConfigurationError(
            f"idempotency_transaction writes the record in the app's PostgreSQL transaction, "
            f"so it needs PostgresStore on the app's database, not {type(store).__name__}: "
            "use store=PostgresStore.from_dsn(dsn) (or your pool), or write the outcome "
            "outside a transaction"
        )
    return IdempotencyTransaction(lease, _adapt(connection), queries)
