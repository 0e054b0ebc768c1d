"""How an ``idempotency_transaction`` the library opened ends decides what the lease writes
after it: a commit that may have landed leaves nothing to delete its record, a commit the
server refused frees the key, and a transaction the app ended itself, or opened where it would
not hold, is refused with what to change. In-process against the real PostgreSQL, on each
driver's connection (asyncpg, SQLAlchemy's AsyncConnection and AsyncSession)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.orm.exc import StaleDataError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    CheckResult,
    EventHook,
    IdempotencyError,
    IdempotencyEvent,
    IdempotencyMiddleware,
    OutcomeResult,
    PostgresStore,
    checkpoint,
    idempotency_transaction,
    idempotent,
    mark_retryable,
)
from tests.stores.transaction_app import first_value, sqlalchemy_url
from tests.support.cli import cli as run_cli
from tests.support.conditions import eventually
from tests.support.cutting_proxy import CuttingProxy
from tests.support.guarded import make_client
from tests.support.link_proxy import LinkProxy

pytestmark = pytest.mark.postgres

DRIVERS = ("asyncpg", "sqlalchemy", "session")

#: What a handler does on its connection in the block, once its outcome is written:
#: ``hook(request, connection)``.
Hook = Callable[[Request, Any], Awaitable[None]]

Fetchval = Callable[..., Awaitable[Any]]


@contextlib.asynccontextmanager
async def connected(driver: str, dsn: str) -> AsyncIterator[tuple[Any, Fetchval]]:
    """A connection of ``driver``'s with no transaction open, so that the block opens (and
    commits) one, and a ``fetchval`` on it."""
    if driver == "asyncpg":
        connection = await asyncpg.connect(dsn)
        try:
            yield connection, connection.fetchval
        finally:
            await connection.close()
        return
    engine = create_async_engine(sqlalchemy_url(dsn), pool_size=1)
    try:
        if driver == "sqlalchemy":
            async with engine.connect() as sa_connection:

                async def fetchval(sql: str, *args: Any) -> Any:
                    return first_value(await sa_connection.exec_driver_sql(sql, args))

                yield sa_connection, fetchval
        else:
            async with AsyncSession(engine) as session:

                async def session_fetchval(sql: str, *args: Any) -> Any:
                    raw = await session.connection()
                    return first_value(await raw.exec_driver_sql(sql, args))

                yield session, session_fetchval
    finally:
        await engine.dispose()


def guarded(
    store: PostgresStore,
    endpoint: Callable[[Request], Awaitable[Response]],
    path: str = "/pay",
    on_event: EventHook | None = None,
    **policy: Any,
) -> Starlette:
    """``endpoint`` at ``POST path``, decorated ``@idempotent(**policy)``, behind the
    middleware on ``store``."""
    app = Starlette(routes=[Route(path, idempotent(**policy)(endpoint), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store, on_event=on_event)
    return app


def paying_app(store: PostgresStore, dsn: str, driver: str, table: str, hook: Hook) -> Starlette:
    """``POST /pay``: a payment row and the 201 outcome in one transaction the block opens on
    a connection to ``dsn``; ``hook`` runs in the block after ``tx.respond()``."""

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        async with (
            connected(driver, dsn) as (connection, fetchval),
            idempotency_transaction(request, connection) as tx,
        ):
            await insert_payment(fetchval, table, key)
            response = await tx.respond(JSONResponse({"paid": key}, status_code=201))
            await hook(request, connection)
            return response

    return guarded(store, pay, lock_ttl_seconds=30)


@contextlib.asynccontextmanager
async def client_of(app: Starlette, store: PostgresStore) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(app, raise_app_exceptions=False) as client:
        yield client
    await store.aclose()


async def payments(sql: Any, table: str, key: str) -> int:
    count: int = await sql.fetchval(
        f"SELECT count(*) FROM {table}_payments WHERE idempotency_key = $1", key
    )
    return count


async def insert_payment(fetchval: Fetchval, table: str, key: str) -> None:
    """The handler's own row: one payment under ``key``."""
    await fetchval(
        f"INSERT INTO {table}_payments (idempotency_key, amount, pod) VALUES ($1, '9.99', '')",
        key,
    )


async def lapse_lock(sql: Any, table: str, key: str) -> None:
    """The lock of ``key`` runs out, on the database's clock (a blocked loop, a pause)."""
    await sql.execute(
        f"UPDATE {table} SET expires_at = now() - interval '1 second' WHERE idempotency_key = $1",
        key,
    )


async def status_of(sql: Any, table: str, key: str) -> str | None:
    status: str | None = await sql.fetchval(
        f"SELECT status FROM {table} WHERE idempotency_key = $1", key
    )
    return status


async def sent_twice(
    app: Starlette, store: PostgresStore, headers: dict[str, str]
) -> tuple[httpx.Response, httpx.Response]:
    """``POST /pay`` with ``headers``, then its retry, on a client that closes ``store``."""
    async with client_of(app, store) as client:
        first = await client.post("/pay", json={}, headers=headers)
        retry = await client.post("/pay", json={}, headers=headers)
    return first, retry


async def assert_run_once(retry: httpx.Response, sql: Any, table: str, key: str) -> None:
    """``retry`` ran the payment (nothing of the first attempt committed), and one stands."""
    assert retry.status_code == 201
    assert "x-idempotent-replay" not in retry.headers
    assert await payments(sql, table, key) == 1


async def assert_left_locked(
    app: Starlette, store: PostgresStore, headers: dict[str, str], sql: Any, table: str
) -> None:
    """The app committed the payment before the outcome: the request fails, the key stays
    locked (its retry gets 409), and one payment stands."""
    first, retry = await sent_twice(app, store, headers)
    assert first.status_code == 500
    assert retry.status_code == 409
    key = headers["Idempotency-Key"]
    assert await status_of(sql, table, key) == "InProgress"
    assert await payments(sql, table, key) == 1


async def assert_replayed_once(retry: httpx.Response, sql: Any, table: str, key: str) -> None:
    """``retry`` got the committed 201 again, and one payment stands."""
    assert retry.status_code == 201
    assert retry.headers["x-idempotent-replay"] == "true"
    assert await payments(sql, table, key) == 1


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_whose_reply_is_lost_is_replayed_not_run_again(
    driver: str,
    proxy: CuttingProxy,
    postgres_dsn: str,
    tables: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server commits the payment and the Completed record, and the connection dies before
    its answer: the request fails, and the retry is replayed. Freeing the key there deleted
    the committed record by its owner token, and the retry paid again."""

    async def lose_the_commits_reply(request: Request, connection: Any) -> None:
        if "x-lose-commit-reply" in request.headers:  # the first attempt only
            proxy.arm("reply", on=b"COMMIT")

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    app = paying_app(store, proxy.proxied(postgres_dsn), driver, tables, lose_the_commits_reply)
    headers = {"Idempotency-Key": "lost-reply"}
    async with client_of(app, store) as client:
        with caplog.at_level(logging.ERROR):
            first = await client.post(
                "/pay", json={}, headers={**headers, "X-Lose-Commit-Reply": "1"}
            )
        assert proxy.cuts_done == 1
        assert first.status_code == 500
        assert "ended without knowing whether it committed" in caplog.text
        assert await status_of(sql, tables, "lost-reply") == "Completed"
        retry = await client.post("/pay", json={}, headers=headers)
    await assert_replayed_once(retry, sql, tables, "lost-reply")


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_request_cancelled_after_its_commit_landed_is_replayed(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The server has committed, its reply is late (held back), and the request is cancelled
    (a timeout, the server shutting down) while the commit waits for it: the retry is
    replayed. Freeing the key there deleted the committed record, and the retry paid again."""
    async with LinkProxy(urlsplit(postgres_dsn).port or 5432) as link:

        async def hold_the_commits_reply(request: Request, connection: Any) -> None:
            if "x-hold-commit-reply" in request.headers:
                link.hold(on=b"COMMIT")

        store = PostgresStore.from_dsn(postgres_dsn, table=tables)
        app = paying_app(store, link.proxied(postgres_dsn), driver, tables, hold_the_commits_reply)

        async def committed() -> bool:
            return await status_of(sql, tables, "cancelled") == "Completed"

        async def cancelled_once_committed(scope: Any, receive: Any, send: Any) -> None:
            running = asyncio.ensure_future(app(scope, receive, send))
            if (b"x-hold-commit-reply", b"1") in scope["headers"]:
                await eventually(committed, message="the commit to land")
                running.cancel()
                link.release()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            if running.cancelled():
                await JSONResponse({}, status_code=503)(scope, receive, send)

        headers = {"Idempotency-Key": "cancelled"}
        async with client_of(cancelled_once_committed, store) as client:  # type: ignore[arg-type]
            first = await client.post(
                "/pay", json={}, headers={**headers, "X-Hold-Commit-Reply": "1"}
            )
            assert first.status_code == 503
            retry = await client.post("/pay", json={}, headers=headers)
    await assert_replayed_once(retry, sql, tables, "cancelled")


@contextlib.asynccontextmanager
async def a_deferred_conflict(sql: Any, table: str) -> AsyncIterator[str]:
    """A statement that fails only at COMMIT: an insert into a deferred unique column (as a
    serialization failure would, the server refuses the commit and rolls it back)."""
    await sql.execute(
        f"CREATE TABLE {table}_deferred (v int UNIQUE DEFERRABLE INITIALLY DEFERRED);"
        f"INSERT INTO {table}_deferred VALUES (1)"
    )
    try:
        yield f"INSERT INTO {table}_deferred VALUES (1)"
    finally:
        await sql.execute(f"DROP TABLE {table}_deferred")


def retrying_app(
    store: PostgresStore,
    dsn: str,
    table: str,
    conflict: str,
    backoff: Callable[[], Awaitable[None]],
    *,
    attempts: int = 2,
    on_event: EventHook | None = None,
) -> Starlette:
    """``POST /pay`` running its own transaction, joined by the block, up to ``attempts``
    times: the first fails at its commit (``conflict``), and after ``backoff`` the second
    commits the payment. The last attempt's failure is raised."""

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        connection = await asyncpg.connect(dsn)
        try:
            for attempt in range(attempts):
                try:
                    async with (
                        connection.transaction(),
                        idempotency_transaction(request, connection) as tx,
                    ):
                        await connection.execute(
                            f"INSERT INTO {table}_payments (idempotency_key, amount, pod) "
                            "VALUES ($1, '9.99', '')",
                            key,
                        )
                        if attempt == 0:
                            await connection.execute(conflict)
                        response = await tx.respond(JSONResponse({}, status_code=201))
                    return response
                except asyncpg.UniqueViolationError:
                    if attempt == attempts - 1:
                        raise
                    await backoff()
            raise AssertionError("unreachable")
        finally:
            await connection.close()

    return guarded(store, pay, on_event=on_event, lock_ttl_seconds=1)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_the_server_refuses_frees_the_key(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """A deferred constraint fails at COMMIT: the server rolled it all back and said so, so the
    key is freed and the retry runs (once)."""
    async with a_deferred_conflict(sql, tables) as conflict:

        async def break_a_deferred_constraint(request: Request, connection: Any) -> None:
            if "x-conflict" in request.headers:
                await _execute(driver, connection, conflict)

        store = PostgresStore.from_dsn(postgres_dsn, table=tables)
        app = paying_app(store, postgres_dsn, driver, tables, break_a_deferred_constraint)
        headers = {"Idempotency-Key": "refused"}
        async with client_of(app, store) as client:
            first = await client.post("/pay", json={}, headers={**headers, "X-Conflict": "1"})
            assert first.status_code == 500
            assert await status_of(sql, tables, "refused") is None
            retry = await client.post("/pay", json={}, headers=headers)
    await assert_run_once(retry, sql, tables, "refused")


async def _begin(driver: str, connection: Any, fetchval: Fetchval) -> None:
    """The app's own transaction, as each driver's users begin one."""
    if driver == "asyncpg":
        await connection.execute("BEGIN")
    else:
        await fetchval("SELECT 1")  # SQLAlchemy begins the transaction


async def _commit(driver: str, connection: Any) -> None:
    if driver == "asyncpg":
        await connection.execute("COMMIT")
    else:
        await connection.commit()


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_of_the_apps_after_the_outcome_is_its_commit(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """``session.commit()`` in the block, after ``tx.respond()``: the record committed with the
    payment. Freeing the key deleted the record, and every retry paid again; refusing it
    answered 500 for a payment that had committed. The block finds its outcome committed,
    and the request ends as though the block had committed it."""

    async def commit_in_the_block(request: Request, connection: Any) -> None:
        await _commit(driver, connection)

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    app = paying_app(store, postgres_dsn, driver, tables, commit_in_the_block)
    headers = {"Idempotency-Key": "committed-inside"}
    first, retry = await sent_twice(app, store, headers)
    assert first.status_code == 201
    await assert_replayed_once(retry, sql, tables, "committed-inside")


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_before_the_outcome_leaves_the_key_locked(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The app commits its payment, then calls ``tx.respond()``: refused, and the key stays
    locked (409) rather than freed for a retry that would pay again at once."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        async with (
            connected(driver, postgres_dsn) as (connection, fetchval),
            idempotency_transaction(request, connection) as tx,
        ):
            await fetchval(
                f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                "VALUES ('early', '9.99', '')"
            )
            await _commit(driver, connection)
            return await tx.respond(JSONResponse({}, status_code=201))

    app = guarded(store, pay)
    headers = {"Idempotency-Key": "early"}
    await assert_left_locked(app, store, headers, sql, tables)


async def test_writes_after_the_apps_commit_in_an_opened_block_are_refused(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The block opened the session's transaction; the app committed after ``tx.respond()``,
    then wrote its outbox row in a transaction the session began afresh, which nobody
    commits: the row was lost without a word. Refused instead."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        async with connected("session", postgres_dsn) as (session, fetchval):
            async with idempotency_transaction(request, session) as tx:
                response = await tx.respond(JSONResponse({}, status_code=201))
                await session.commit()
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('after', '9.99', '')"
                )
            return response

    app = guarded(store, pay)
    async with client_of(app, store) as client:
        first = await client.post("/pay", json={}, headers={"Idempotency-Key": "after"})
    assert first.status_code == 500
    assert await payments(sql, tables, "after") == 0


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_in_a_joined_block_leaves_the_key_locked(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The app's transaction is open (a SELECT began it) when the block joins it; the app
    commits its payment in the block, then calls ``tx.respond()``. The record was written in
    a transaction nobody committed, and every retry paid again once the lock lapsed: refused,
    and the key stays locked (409)."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        async with connected(driver, postgres_dsn) as (connection, fetchval):
            await _begin(driver, connection, fetchval)
            async with idempotency_transaction(request, connection) as tx:
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('joined', '9.99', '')"
                )
                await _commit(driver, connection)
                response = await tx.respond(JSONResponse({}, status_code=201))
            await _commit(driver, connection)
            return response

    app = guarded(store, pay)
    headers = {"Idempotency-Key": "joined"}
    await assert_left_locked(app, store, headers, sql, tables)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_recovery_point_after_a_lapsed_lock_commits(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The lock lapsed before the block (a blocked loop, a pause), and nobody took the key
    over: the fence lets the request in, so its recovery point must be written too. It was
    refused as a lock taken over, and the only request for the key got 409."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        await lapse_lock(sql, tables, key)
        async with (
            connected(driver, postgres_dsn) as (connection, fetchval),
            idempotency_transaction(request, connection) as tx,
        ):
            await insert_payment(fetchval, tables, key)
            await tx.checkpoint("paid")
            return await tx.respond(JSONResponse({"paid": key}, status_code=201))

    app = guarded(store, pay, renew_lock=False)
    headers = {"Idempotency-Key": "lapsed"}
    first, retry = await sent_twice(app, store, headers)
    assert first.status_code == 201
    await assert_replayed_once(retry, sql, tables, "lapsed")


@pytest.mark.parametrize("saved", ["", "saved"], ids=["before a write", "after a checkpoint"])
@pytest.mark.parametrize("lapsed", [False, True], ids=["live lock", "lapsed lock"])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_retry_while_the_block_is_open_is_answered_409_at_once(
    driver: str, postgres_dsn: str, tables: str, sql: Any, lapsed: bool, saved: str
) -> None:
    """A retry comes while the first attempt's transaction is open (a provider call in the
    block, say). The fence wrote the row, so the retry's insert waited for that transaction,
    and past ``store_timeout_seconds`` it got 503, logged and counted as a store error, even
    with the lock live; so did it after a recovery point in the block, which writes the row.
    Once the lock had lapsed, the takeover waited for the row the same way. The retry now reads
    the holder (409). The block's recovery point after a lapsed lock is still the request's."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    inside, retried = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        if lapsed and not inside.is_set():  # on the database's clock, before the fence
            await lapse_lock(sql, tables, key)
        async with (
            connected(driver, postgres_dsn) as (connection, fetchval),
            idempotency_transaction(request, connection) as tx,
        ):
            await insert_payment(fetchval, tables, key)
            if saved:
                await tx.checkpoint("saved")
            inside.set()
            await retried.wait()
            await tx.checkpoint("paid")
            return await tx.respond(JSONResponse({"paid": key}, status_code=201))

    events: list[IdempotencyEvent] = []
    app = guarded(store, pay, on_event=events.append, renew_lock=False)
    headers = {"Idempotency-Key": "open"}
    async with client_of(app, store) as client:
        first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
        await inside.wait()
        retry = await client.post("/pay", json={}, headers=headers)
        retried.set()
        assert (await first).status_code == 201
        again = await client.post("/pay", json={}, headers=headers)
    assert retry.status_code == 409
    assert not [event for event in events if event.result == CheckResult.STORE_ERROR]
    await assert_replayed_once(again, sql, tables, "open")


@pytest.mark.parametrize("joined", [False, True], ids=["opened", "joined"])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_recovery_point_leaves_a_lease_counted_from_the_commit(
    driver: str, postgres_dsn: str, tables: str, sql: Any, joined: bool
) -> None:
    """A block saved a recovery point and went on longer than the lock's TTL before its
    commit; the handler went on after it. The lease, counted from the recovery point's
    statement, had run out when it committed: a retry recovered the key at once and ran the
    handler beside the first. The lease now runs from the commit (from the block's end, in a
    transaction of the app's that it joined)."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    committed, retried = asyncio.Event(), asyncio.Event()
    runs = 0

    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        if runs == 1:
            async with connected(driver, postgres_dsn) as (connection, fetchval):
                if joined:
                    await _begin(driver, connection, fetchval)
                async with idempotency_transaction(request, connection) as tx:
                    await insert_payment(fetchval, tables, request.headers["idempotency-key"])
                    await tx.checkpoint("paid")
                    await asyncio.sleep(1.2)  # the block's work goes on past the lock's TTL
                if joined:
                    await _commit(driver, connection)
            committed.set()
            await retried.wait()  # the handler goes on after the block
        return JSONResponse({"run": runs}, status_code=201)

    app = guarded(store, pay, lock_ttl_seconds=1, renew_lock=False)
    headers = {"Idempotency-Key": "long-block"}
    async with client_of(app, store) as client:
        first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
        await committed.wait()
        try:
            retry = await client.post("/pay", json={}, headers=headers)
        finally:
            retried.set()
        assert (await first).status_code == 201
    assert retry.status_code == 409
    assert runs == 1


async def test_an_operator_deletes_no_outcome_a_block_is_committing(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The handler saved a recovery point, stalled past its lease, then fenced its row and
    wrote its payment. ``list --stuck`` showed the record, and ``delete`` (without --force:
    its lease had run out) waited for the block's transaction, then deleted the outcome it
    had just committed: the next retry paid again. The delete now takes the lapsed record over
    first, which the open transaction holds, and is refused."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    inside, deleted = asyncio.Event(), asyncio.Event()

    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        if not inside.is_set():
            await checkpoint(request, "charging")
            await sql.execute(  # the lease runs out (on the database's clock): a stall
                f"UPDATE {tables} SET locked_until = now() - interval '1 second' "
                "WHERE idempotency_key = $1",
                key,
            )
        async with (
            connected("asyncpg", postgres_dsn) as (connection, fetchval),
            idempotency_transaction(request, connection) as tx,
        ):
            await insert_payment(fetchval, tables, key)
            inside.set()
            await deleted.wait()
            return await tx.respond(JSONResponse({"paid": key}, status_code=201))

    app = guarded(store, pay, renew_lock=False)
    headers = {"Idempotency-Key": "stalled"}
    async with client_of(app, store) as client:
        first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
        await inside.wait()
        try:
            command = ("delete", "--dsn", postgres_dsn, "--table", tables, "--route", "/pay")
            operator = await asyncio.to_thread(run_cli, *command, "stalled")
        finally:
            deleted.set()
        assert (await first).status_code == 201
        retry = await client.post("/pay", json={}, headers=headers)
    assert operator.code == 1
    assert "its transaction is writing its outcome" in operator.err
    await assert_replayed_once(retry, sql, tables, "stalled")


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_block_that_records_nothing_is_refused_and_commits_nothing(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """A block that writes the payment but neither the outcome nor a recovery point, then a
    500 after it: the 500 freed the key, and every retry paid again."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    refused: list[str] = []

    async def pay(request: Request) -> Response:
        try:
            async with (
                connected(driver, postgres_dsn) as (connection, fetchval),
                idempotency_transaction(request, connection),
            ):
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('silent', '9.99', '')"
                )
        except IdempotencyError as exc:
            refused.append(str(exc))
        return JSONResponse({}, status_code=500)

    app = guarded(store, pay)
    headers = {"Idempotency-Key": "silent"}
    async with client_of(app, store) as client:
        for _ in range(2):
            assert (await client.post("/pay", json={}, headers=headers)).status_code == 500
    assert len(refused) == 2
    assert "ended without tx.respond() or tx.checkpoint()" in refused[0]
    assert await payments(sql, tables, "silent") == 0


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_recovery_point_in_a_long_transaction_commits_with_a_live_lease(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The app's transaction began more than a lock's TTL before the block. Inside it,
    ``now()`` is when it began: the recovery point's lease was counted from then, committed
    already over, and a retry recovered the key while the handler still ran."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    leases: list[bool] = []

    async def pay(request: Request) -> Response:
        async with connected(driver, postgres_dsn) as (connection, fetchval):
            await _begin(driver, connection, fetchval)
            await asyncio.sleep(1.5)  # the app's work, the lock renewed meanwhile
            async with idempotency_transaction(request, connection) as tx:
                await tx.checkpoint("charged")
            await _commit(driver, connection)
        leases.append(
            await sql.fetchval(
                f"SELECT locked_until > clock_timestamp() FROM {tables} "
                "WHERE idempotency_key = 'long'"
            )
        )
        return JSONResponse({}, status_code=201)

    app = guarded(store, pay, lock_ttl_seconds=1)
    async with client_of(app, store) as client:
        first = await client.post("/pay", json={}, headers={"Idempotency-Key": "long"})
    assert first.status_code == 201
    assert leases == [True]


async def test_a_transaction_after_the_response_is_refused(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """From a background task, after a 500 freed the key: refused before it writes. Let through,
    its commit raced the release, which deleted its Completed record by the owner token."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    refused: list[BaseException] = []

    async def pay_later(request: Request) -> None:
        try:
            async with (
                connected("asyncpg", postgres_dsn) as (connection, fetchval),
                idempotency_transaction(request, connection) as tx,
            ):
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('later', '9.99', '')"
                )
                await tx.respond(JSONResponse({}, status_code=201))
        except IdempotencyError as exc:
            refused.append(exc)

    async def pay(request: Request) -> Response:
        return JSONResponse({}, status_code=500, background=BackgroundTask(pay_later, request))

    app = guarded(store, pay)
    async with client_of(app, store) as client:
        first = await client.post("/pay", json={}, headers={"Idempotency-Key": "later"})
    assert first.status_code == 500
    assert len(refused) == 1
    assert "after its response ended" in str(refused[0])
    assert await payments(sql, tables, "later") == 0


@pytest.mark.parametrize("driver", ["sqlalchemy", "session"])
async def test_a_transaction_in_a_savepoint_is_refused(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """Inside ``begin_nested()``: a rollback to the savepoint would undo the record while the
    outer transaction's writes commit, and the retry would run them again."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        async with (
            connected(driver, postgres_dsn) as (connection, _),
            connection.begin(),
            connection.begin_nested(),
            idempotency_transaction(request, connection) as tx,
        ):
            return await tx.respond(JSONResponse({}, status_code=201))

    app = guarded(store, pay)
    with pytest.raises(IdempotencyError, match="inside a savepoint"):
        async with make_client(app) as client:
            await client.post("/pay", json={}, headers={"Idempotency-Key": "nested"})
    await store.aclose()
    assert await status_of(sql, tables, "nested") is None


def account_model(table: str) -> type[Any]:
    """An ORM model of ``{table}_accounts``, versioned (``version_id_col``) as an app guarding
    against lost updates does."""

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = f"{table}_accounts"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        version: Mapped[int] = mapped_column()
        __mapper_args__ = {"version_id_col": version}  # noqa: RUF012 - SQLAlchemy's own

    return Account


@contextlib.asynccontextmanager
async def accounts(postgres_dsn: str, table: str) -> AsyncIterator[tuple[Any, type[Any]]]:
    """An engine, and the model of a table of one account (id 1) it holds."""
    model = account_model(table)
    engine = create_async_engine(sqlalchemy_url(postgres_dsn))
    try:
        async with engine.begin() as connection:
            await connection.run_sync(model.metadata.create_all)
        async with AsyncSession(engine) as session:
            session.add(model(id=1, balance=100))
            await session.commit()
        yield engine, model
        async with engine.begin() as connection:
            await connection.run_sync(model.metadata.drop_all)
    finally:
        await engine.dispose()


async def test_a_flush_that_fails_in_the_block_frees_the_key(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """A session's failed flush deactivates its transaction without ending it: the app's own
    commit or rollback it is not, and nothing committed. The app answers 409 and marks it
    retryable, and the retry runs; taken for the app's commit, the key stayed locked."""
    runs: list[int] = []
    async with accounts(postgres_dsn, tables) as (engine, model):

        async def open_account(request: Request) -> Response:
            runs.append(1)
            async with AsyncSession(engine) as session:
                try:
                    async with idempotency_transaction(request, session) as tx:
                        session.add(model(id=1, balance=0))  # taken: the flush fails
                        await session.flush()
                        return await tx.respond(JSONResponse({}, status_code=201))
                except IntegrityError:
                    mark_retryable(request)
                    return JSONResponse({"error": "taken"}, status_code=409)

        store = PostgresStore.from_dsn(postgres_dsn, table=tables)
        app = guarded(store, open_account, path="/open")
        headers = {"Idempotency-Key": "flush"}
        async with client_of(app, store) as client:
            first = await client.post("/open", json={}, headers=headers)
            retry = await client.post("/open", json={}, headers=headers)
    assert first.status_code == retry.status_code == 409
    assert retry.json() == {"error": "taken"}
    assert runs == [1, 1]
    assert await status_of(sql, tables, "flush") is None


async def test_a_flush_that_fails_as_the_block_ends_frees_the_key(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The block's commit flushes a stale update first (``StaleDataError``, no SQLSTATE): no
    COMMIT went out, so the key is freed and the retry runs, rather than waiting out the
    lock."""
    runs: list[int] = []
    async with accounts(postgres_dsn, tables) as (engine, model):

        async def withdraw(request: Request) -> Response:
            runs.append(1)
            try:
                async with (
                    AsyncSession(engine) as session,
                    idempotency_transaction(request, session) as tx,
                ):
                    account = await session.get(model, 1)
                    assert account is not None
                    if len(runs) == 1:  # another writer updates the account meanwhile
                        await sql.execute(f"UPDATE {tables}_accounts SET version = version + 1")
                    account.balance -= 10
                    return await tx.respond(JSONResponse({}, status_code=201))
            except StaleDataError:
                mark_retryable(request)
                return JSONResponse({"error": "changed meanwhile"}, status_code=409)

        store = PostgresStore.from_dsn(postgres_dsn, table=tables)
        app = guarded(store, withdraw, path="/withdraw")
        headers = {"Idempotency-Key": "stale"}
        async with client_of(app, store) as client:
            first = await client.post("/withdraw", json={}, headers=headers)
            assert await status_of(sql, tables, "stale") is None
            retry = await client.post("/withdraw", json={}, headers=headers)
    assert first.status_code == 409
    assert retry.status_code == 201
    assert runs == [1, 1]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_on_a_connection_closed_before_it_frees_the_key(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """No COMMIT goes out on a closed connection, and the driver says so: nothing committed,
    the key is freed at once and the retry runs (once)."""

    async def close_the_connection(request: Request, connection: Any) -> None:
        if "x-close" not in request.headers:
            return
        if driver == "asyncpg":
            connection.terminate()
            return
        if driver == "session":
            connection = await connection.connection()
        (await connection.get_raw_connection()).driver_connection.terminate()

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    app = paying_app(store, postgres_dsn, driver, tables, close_the_connection)
    headers = {"Idempotency-Key": "closed"}
    with pytest.raises(Exception, match="connection is closed"):
        async with make_client(app) as raising:
            await raising.post("/pay", json={}, headers={**headers, "X-Close": "1"})
    assert await status_of(sql, tables, "closed") is None
    async with client_of(app, store) as client:
        retry = await client.post("/pay", json={}, headers=headers)
    await assert_run_once(retry, sql, tables, "closed")


async def test_the_apps_retry_of_its_own_transaction_may_enter_the_block_again(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The app's transaction, joined by the block, fails at its commit (a deferred constraint,
    as a serialization failure would) and the app runs it again: the second block is let in
    (it was refused as "already in an idempotency_transaction"), and its outcome stays."""
    backoffs: list[int] = []

    async def backoff() -> None:
        backoffs.append(1)

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    headers = {"Idempotency-Key": "again"}
    async with a_deferred_conflict(sql, tables) as conflict:
        app = retrying_app(store, postgres_dsn, tables, conflict, backoff)
        async with client_of(app, store) as client:
            first = await client.post("/pay", json={}, headers=headers)
            retry = await client.post("/pay", json={}, headers=headers)
    assert first.status_code == 201, first.text
    assert backoffs == [1]
    assert await status_of(sql, tables, "again") == "Completed"
    await assert_replayed_once(retry, sql, tables, "again")


async def test_a_joined_transaction_whose_commit_fails_is_in_doubt_not_completed(
    postgres_dsn: str, tables: str, sql: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The app's transaction, joined by the block, fails at its commit and the app gives up
    (a 500). The outcome the block recorded rolled back with it: the request is reported in
    doubt (it was COMPLETED, with an error blaming the app's response), and its lock lapses;
    a retry then runs the payment, once."""
    events: list[IdempotencyEvent] = []

    async def never() -> None:
        raise AssertionError("one attempt: no backoff")

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    headers = {"Idempotency-Key": "given-up"}
    async with a_deferred_conflict(sql, tables) as conflict:
        app = retrying_app(
            store, postgres_dsn, tables, conflict, never, attempts=1, on_event=events.append
        )
        async with client_of(app, store) as client:
            first = await client.post("/pay", json={}, headers=headers)
            assert first.status_code == 500
            assert await status_of(sql, tables, "given-up") == "InProgress"
            assert await payments(sql, tables, "given-up") == 0

            async def retried() -> httpx.Response | None:
                retry = await client.post("/pay", json={}, headers=headers)
                return None if retry.status_code == 409 else retry

            retry = await eventually(retried, message="the lock to lapse")
    outcomes = [(e.result, e.note) for e in events if e.event == "idempotency_outcome"]
    assert outcomes[0] == (OutcomeResult.LOCK_LOST, "in_doubt")
    assert "may not have committed" in caplog.text
    assert "differs from the one" not in caplog.text
    assert retry.status_code == 500  # the conflict stands: the app fails again, and gives up
    assert await payments(sql, tables, "given-up") == 0


async def _execute(driver: str, connection: Any, statement: str) -> None:
    if driver == "asyncpg":
        await connection.execute(statement)
    elif driver == "sqlalchemy":
        await connection.exec_driver_sql(statement)
    else:
        await (await connection.connection()).exec_driver_sql(statement)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_transaction_a_caught_error_aborted_commits_nothing_and_says_so(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """After ``tx.respond()`` a statement fails and the app catches its error: the transaction
    is aborted, and PostgreSQL answers its COMMIT with a ROLLBACK that no driver raises. The
    block raises instead, and the key is freed; the client was answered 201 for a payment
    that never committed, reported COMPLETED, and its retry got 409."""

    async def fail_a_statement_quietly(request: Request, connection: Any) -> None:
        if "x-fail" in request.headers:
            with contextlib.suppress(Exception):  # the app's handling of its own error
                await _execute(driver, connection, "SELECT 1/0")

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    app = paying_app(store, postgres_dsn, driver, tables, fail_a_statement_quietly)
    headers = {"Idempotency-Key": "aborted"}
    async with client_of(app, store) as client:
        first = await client.post("/pay", json={}, headers={**headers, "X-Fail": "1"})
        assert first.status_code == 500
        assert await status_of(sql, tables, "aborted") is None
        assert await payments(sql, tables, "aborted") == 0
        retry = await client.post("/pay", json={}, headers=headers)
    await assert_run_once(retry, sql, tables, "aborted")


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_commit_the_server_cancels_frees_the_key(
    driver: str, postgres_dsn: str, tables: str, sql: Any
) -> None:
    """``pg_cancel_backend`` while COMMIT runs a deferred trigger: the server rolled back and
    said so (57014), so the key is freed at once, not held for its lock TTL."""
    await sql.execute(
        f"CREATE TABLE {tables}_slow (v int);"
        f"CREATE FUNCTION {tables}_sleep() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$;"
        f"CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON {tables}_slow "
        f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {tables}_sleep()"
    )

    async def slow_down_the_commit(request: Request, connection: Any) -> None:
        if "x-slow" in request.headers:
            await _execute(driver, connection, f"INSERT INTO {tables}_slow VALUES (1)")

    async def committing() -> int | None:
        pid: int | None = await sql.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query ILIKE 'COMMIT%'"
            " AND pid <> pg_backend_pid()"
        )
        return pid

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    app = paying_app(store, postgres_dsn, driver, tables, slow_down_the_commit)
    headers = {"Idempotency-Key": "cancelled-by-server"}
    try:
        async with client_of(app, store) as client:
            first = asyncio.create_task(
                client.post("/pay", json={}, headers={**headers, "X-Slow": "1"})
            )
            pid = await eventually(committing, message="the COMMIT to run its trigger")
            await sql.execute("SELECT pg_cancel_backend($1)", pid)
            assert (await first).status_code == 500
            assert await status_of(sql, tables, "cancelled-by-server") is None
            retry = await client.post("/pay", json={}, headers=headers)
    finally:
        await sql.execute(f"DROP TABLE {tables}_slow; DROP FUNCTION {tables}_sleep()")
    await assert_run_once(retry, sql, tables, "cancelled-by-server")


async def test_two_blocks_in_one_transaction_of_the_apps_are_refused(
    postgres_dsn: str, tables: str
) -> None:
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        connection = await asyncpg.connect(postgres_dsn)
        try:
            async with connection.transaction():
                async with idempotency_transaction(request, connection) as tx:
                    await tx.respond(JSONResponse({}, status_code=201))
                async with idempotency_transaction(request, connection) as tx:
                    return await tx.respond(JSONResponse({}, status_code=201))
        finally:
            await connection.close()

    app = guarded(store, pay)
    with pytest.raises(IdempotencyError, match="already in an idempotency_transaction"):
        async with make_client(app) as client:
            await client.post("/pay", json={}, headers={"Idempotency-Key": "twice"})
    await store.aclose()


async def test_the_lock_is_renewed_while_the_app_runs_its_transaction_again(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """Between the app's failed commit and its next attempt (a backoff, say), the lock is
    still renewed: its renewal stopped for good at the first block, the lock lapsed, and a
    retry ran the handler beside it."""
    failed, go_on = asyncio.Event(), asyncio.Event()

    async def backoff() -> None:
        failed.set()
        await go_on.wait()

    async def lock_outlived(deadline: float) -> bool:
        expires = await sql.fetchval(
            f"SELECT extract(epoch FROM expires_at) FROM {tables} WHERE idempotency_key = $1",
            "renewed",
        )
        return float(expires) > deadline

    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    headers = {"Idempotency-Key": "renewed"}
    async with a_deferred_conflict(sql, tables) as conflict:
        app = retrying_app(store, postgres_dsn, tables, conflict, backoff)
        try:
            async with client_of(app, store) as client:
                first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
                await eventually(failed.is_set, message="the app's first commit to fail")
                lapse = float(await sql.fetchval("SELECT extract(epoch FROM now())")) + 1.5
                await eventually(lambda: lock_outlived(lapse), message="the lock to be renewed")
                assert (await client.post("/pay", json={}, headers=headers)).status_code == 409
                go_on.set()
                assert (await first).status_code == 201
                retry = await client.post("/pay", json={}, headers=headers)
        finally:
            go_on.set()  # a failed assertion leaves no handler waiting
    await assert_replayed_once(retry, sql, tables, "renewed")


async def test_a_joined_transaction_a_caught_error_aborted_is_refused_at_the_blocks_end(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """In the app's own transaction: the app would commit it after the block, and PostgreSQL
    would answer with a ROLLBACK no driver raises. The block's end raises instead, so the
    client is not told 201 for a payment that never committed, and the key is freed."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    async def pay(request: Request) -> Response:
        connection = await asyncpg.connect(postgres_dsn)
        try:
            async with connection.transaction():
                async with idempotency_transaction(request, connection) as tx:
                    response = await tx.respond(JSONResponse({}, status_code=201))
                    with contextlib.suppress(asyncpg.DivisionByZeroError):
                        await connection.execute("SELECT 1/0")
                return response
        finally:
            await connection.close()

    headers = {"Idempotency-Key": "joined-aborted"}
    with pytest.raises(asyncpg.InFailedSQLTransactionError):
        async with make_client(guarded(store, pay)) as client:
            await client.post("/pay", json={}, headers=headers)
    await store.aclose()
    assert await status_of(sql, tables, "joined-aborted") is None
