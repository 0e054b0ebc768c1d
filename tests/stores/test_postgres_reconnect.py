"""Connections the server ended: run again once when the statement certainly had no effect.

The server ends connections on ``pg_terminate_backend``, a clean restart or switchover, and
``idle_session_timeout``; it sends a FATAL notice first, and asyncpg raises it (as the cause of
``ConnectionDoesNotExistError``) on the pool's next statement over that connection. Such a
statement never ran, or was rolled back with its backend, so the store sends it again on a new
connection, as it does when asyncpg refused to send it (the notice read, the end not yet). A
connection that dies with no such notice after the statement went out (a network failure, a
crash) is different: the statement may have committed, so it is never sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, idempotent
from starlette_idempotency._record import Checkpoint
from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores._postgres_connections import ended_while_idle
from starlette_idempotency.stores._postgres_connections import never_ran as statement_never_ran
from starlette_idempotency.stores.base import FencedWrite
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._postgres_server import PostgresServer
from tests.support.conditions import eventually
from tests.support.cutting_proxy import CuttingProxy
from tests.support.guarded import make_client
from tests.support.link_proxy import LinkProxy
from tests.support.postgres import (
    LOCK_TTL,
    TTL,
    completed,
    expire,
    lock_waiter,
    pending,
    rows_locked,
    terminate_backends,
    terminate_with_notices_read,
    wait_for_no_backends,
)

pytestmark = pytest.mark.postgres

POOL_SIZE = 3
#: Requests (each a new key, then its replay) sent while the server ends the connections.
ROUNDS = 8
STORE_LOGGER = "starlette_idempotency.stores.postgres"


@pytest.fixture
async def store(
    postgres_dsn: str, postgres_table: str, application_name: str
) -> AsyncIterator[PostgresStore]:
    """A store whose connections (all opened up front) carry the test's application name."""
    opened = await PostgresStore.connect(
        postgres_dsn,
        table=postgres_table,
        min_size=POOL_SIZE,
        max_size=POOL_SIZE,
        server_settings={"application_name": application_name},
    )
    try:
        await opened.create_schema()
        yield opened
    finally:
        await opened.aclose()


@contextlib.asynccontextmanager
async def behind_a_link(
    postgres_dsn: str, postgres_table: str, **pool_options: Any
) -> AsyncIterator[tuple[LinkProxy, PostgresStore]]:
    """A store whose connections (all opened up front) reach PostgreSQL through a
    :class:`LinkProxy`."""
    parts = urlsplit(postgres_dsn)
    async with LinkProxy(parts.port or 5432, parts.hostname or "127.0.0.1") as link:
        store = await PostgresStore.connect(
            link.proxied(postgres_dsn),
            table=postgres_table,
            min_size=POOL_SIZE,
            max_size=POOL_SIZE,
            **pool_options,
        )
        try:
            await store.create_schema()
            yield link, store
        finally:
            await store.aclose()


@contextlib.asynccontextmanager
async def ends_kept_back(
    postgres_dsn: str, postgres_table: str, application_name: str
) -> AsyncIterator[tuple[PostgresStore, Callable[[], Awaitable[int]]]]:
    """A store behind a link that keeps the ends of connections back, and a function that
    ends its connections and returns once their termination notices have been read (see
    :func:`terminate_with_notices_read`), saying how many it ended."""
    opened: list[Any] = []

    async def remember(connection: Any) -> None:  # the pool's init, for each new connection
        opened.append(connection)

    async with behind_a_link(
        postgres_dsn,
        postgres_table,
        server_settings={"application_name": application_name},
        init=remember,
    ) as (link, store):
        link.keep_ends()

        def end_connections() -> Awaitable[int]:
            return terminate_with_notices_read(postgres_dsn, application_name, link, opened)

        yield store, end_connections


def retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == STORE_LOGGER and "running it again" in record.getMessage()
    ]


HELD = pending("owner-1", key="k")


async def arrange(store: PostgresStore, sql: Any, table: str) -> None:
    """The rows the operations work on: ``k`` held by ``HELD``, and ``old`` expired (for
    purge_expired)."""
    assert (await store.try_acquire("k", HELD, LOCK_TTL)).acquired
    assert (await store.try_acquire("old", pending("owner-0", key="old"), LOCK_TTL)).acquired
    await expire(sql, table, "old")


async def acquire_free(store: PostgresStore) -> bool:
    return (await store.try_acquire("free", pending("owner-2", key="free"), LOCK_TTL)).acquired


async def acquire_held(store: PostgresStore) -> bool:
    held = await store.try_acquire("k", pending("owner-2"), LOCK_TTL)
    return not held.acquired and held.record is not None and held.record.owner_token == "owner-1"


async def finish(store: PostgresStore) -> bool:
    return await store.finish("k", completed(HELD), TTL) is FencedWrite.WRITTEN


async def save_progress(store: PostgresStore) -> bool:
    saved = replace(HELD, checkpoints=(Checkpoint("step", 1, at=1.0),))
    return await store.save_progress("k", saved, TTL, LOCK_TTL)


async def release(store: PostgresStore) -> bool:
    return await store.release("k", "owner-1") and await store.get("k") is None


async def renew(store: PostgresStore) -> bool:
    return await store.renew("k", "owner-1", LOCK_TTL)


async def get(store: PostgresStore) -> bool:
    found = await store.get("k")
    return found is not None and found.owner_token == "owner-1"


async def purge_expired(store: PostgresStore) -> bool:
    return await store.purge_expired() == 1


async def check(store: PostgresStore) -> bool:
    return all(finding.level == "warning" for finding in await store.check())


OPERATIONS = [
    acquire_free,
    acquire_held,
    finish,
    save_progress,
    release,
    renew,
    get,
    purge_expired,
    check,
]


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.__name__ for op in OPERATIONS])
async def test_each_operation_succeeds_at_once_after_the_server_ended_its_connections(
    operation: Callable[[PostgresStore], Awaitable[bool]],
    store: PostgresStore,
    postgres_dsn: str,
    postgres_table: str,
    application_name: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await arrange(store, sql, postgres_table)

    assert terminate_backends(postgres_dsn, application_name) == POOL_SIZE
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert await operation(store)
    [retry] = retries(caplog)
    assert "ended the pooled connection while idle" in retry  # its notice waits unread


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.__name__ for op in OPERATIONS])
async def test_each_operation_succeeds_after_its_connections_died_without_a_word(
    operation: Callable[[PostgresStore], Awaitable[bool]],
    postgres_dsn: str,
    postgres_table: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A crash, an immediate shutdown, a failover or a network that drops idle connections
    says nothing: the connection is just closed while the pool holds it. A statement sent on
    it then meets a closed connection with no word that it did not run; the store looks first,
    and takes a new connection."""
    async with behind_a_link(postgres_dsn, postgres_table) as (link, store):
        await arrange(store, sql, postgres_table)

        link.drop()  # this event loop has not read the ends of the connections yet
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
            assert await operation(store)
        [retry] = retries(caplog)
        assert "ended the pooled connection while idle" in retry


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.__name__ for op in OPERATIONS])
async def test_each_operation_succeeds_after_the_notices_of_its_connections_end_were_read(
    operation: Callable[[PostgresStore], Awaitable[bool]],
    postgres_dsn: str,
    postgres_table: str,
    application_name: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A terminated backend sends its notice, then exits: its end comes a moment later. In
    between, a pooled connection whose notice the event loop has read looks alive (open,
    nothing to read), but asyncpg's protocol is no longer idle and refuses to send on it.
    Nothing went out: the store runs the operation again, on a new connection."""
    async with ends_kept_back(postgres_dsn, postgres_table, application_name) as (
        store,
        end_connections,
    ):
        await arrange(store, sql, postgres_table)

        assert await end_connections() == POOL_SIZE
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
            assert await operation(store)
        [retry] = retries(caplog)
        assert "cannot switch to state" in retry  # asyncpg's refusal to send


async def test_no_key_runs_twice_while_the_server_ends_the_connections(
    postgres_dsn: str,
    postgres_table: str,
    application_name: str,
) -> None:
    """Round after round, the server ends the store's connections before a request's acquire,
    while its handler runs (so the outcome's write meets them), and before its replay; the
    client sends again after a 503 or 409, as a client does. Each key runs once, and is
    answered the same each time: an outcome's write that failed would leave the key
    InProgress, and the retry after the lock lapsed would run the handler again."""
    runs: Counter[str] = Counter()
    answered: Counter[int] = Counter()
    async with ends_kept_back(postgres_dsn, postgres_table, application_name) as (
        store,
        end_connections,
    ):

        @idempotent(lock_ttl_seconds=1)
        async def pay(request: Request) -> Response:
            key = request.headers["Idempotency-Key"]
            runs[key] += 1
            await end_connections()
            return JSONResponse({"key": key, "run": runs[key]}, status_code=201)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        client = make_client(IdempotencyMiddleware(app, store=store))

        async def served(key: str) -> httpx.Response:
            async def attempt() -> httpx.Response | None:
                response = await client.post("/pay", json={}, headers={"Idempotency-Key": key})
                answered[response.status_code] += 1
                return None if response.status_code in (409, 503) else response

            return await eventually(
                attempt, timeout=10, interval=0.05, message=f"key {key!r} to be served"
            )

        keys = [f"key-{round_}" for round_ in range(ROUNDS)]
        for key in keys:
            await end_connections()
            first = await served(key)
            await end_connections()
            again = await served(key)
            assert (first.status_code, first.json()) == (201, {"key": key, "run": 1})
            assert (again.status_code, again.json()) == (201, first.json())

    assert runs == Counter(dict.fromkeys(keys, 1))
    assert answered == Counter({201: 2 * ROUNDS})  # served at once: no 503, no 409


async def test_a_statement_ended_while_it_waits_is_run_again(
    store: PostgresStore,
    postgres_dsn: str,
    postgres_table: str,
    application_name: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The notice can also come while the statement runs: then it was rolled back."""
    assert (await store.try_acquire("k", HELD, LOCK_TTL)).acquired
    watcher = await asyncpg.connect(postgres_dsn)
    try:
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
            async with rows_locked(sql, postgres_table):
                finishing = asyncio.create_task(store.finish("k", completed(HELD), TTL))
                first = await lock_waiter(watcher, application_name)
                assert terminate_backends(postgres_dsn, application_name) == POOL_SIZE
                second = await lock_waiter(watcher, application_name)  # run again
                assert second != first
            assert await finishing is FencedWrite.WRITTEN
        assert len(retries(caplog)) == 1
    finally:
        await watcher.close()


@pytest.mark.parametrize(("cut", "committed"), [("request", False), ("reply", True)])
async def test_a_connection_lost_without_notice_is_not_run_again(
    cut: Any,
    committed: bool,
    proxy: CuttingProxy,
    postgres_dsn: str,
    postgres_table: str,
    sql: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whether the statement ran is unknown to the client, so it fails (and the middleware
    answers 503): sent again, a statement that had committed would run twice."""
    store = await PostgresStore.connect(
        proxy.proxied(postgres_dsn), table=postgres_table, min_size=0, max_size=1
    )
    try:
        await store.create_schema()
        await store.try_acquire("k", HELD, LOCK_TTL)
        warm = pending("owner-w", key="warm")
        await store.finish("warm", completed(warm), TTL)  # `finish` is prepared: one exchange

        proxy.arm(cut)
        with caplog.at_level(logging.WARNING, logger=STORE_LOGGER), pytest.raises(StoreError) as e:
            await store.finish("k", completed(HELD), TTL)
        assert proxy.cuts_done == 1
        lost = e.value.__cause__
        assert isinstance(lost, asyncpg.ConnectionDoesNotExistError)
        assert not isinstance(lost.__cause__, asyncpg.PostgresError)  # no word from the server
        assert proxy.connections == 1  # nothing was sent again
        assert retries(caplog) == []
        status = await sql.fetchval(
            f"SELECT status FROM {postgres_table} WHERE key = 'idempotency:k'"
        )
        assert status == ("Completed" if committed else "InProgress")

        assert await store.finish("k", completed(HELD), TTL) is FencedWrite.WRITTEN
    finally:
        await store.aclose()


# --- the classification, on errors produced by a real server --------------------------------


async def raised(statement: Callable[[], Awaitable[Any]]) -> BaseException:
    try:
        await statement()
    except Exception as exc:
        return exc
    raise AssertionError("the statement did not fail")


async def terminated_while_idle(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    connection = await asyncpg.connect(dsn, server_settings={"application_name": name})
    await connection.fetchval("SELECT 1")
    terminate_backends(dsn, name)
    return await raised(lambda: connection.fetchval("SELECT 1"))  # the connection is gone


async def terminated_while_running(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    holder = await asyncpg.connect(dsn)
    victim = await asyncpg.connect(dsn, server_settings={"application_name": name})
    try:
        await holder.execute("SELECT pg_advisory_lock(4242)")
        waiting = asyncio.create_task(victim.execute("SELECT pg_advisory_lock(4242)"))
        await lock_waiter(holder, name)
        terminate_backends(dsn, name)
        return await raised(lambda: waiting)
    finally:
        await holder.close()


async def idle_session_timeout(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    connection = await asyncpg.connect(
        dsn, server_settings={"application_name": name, "idle_session_timeout": "50"}
    )
    await connection.fetchval("SELECT 1")
    wait_for_no_backends(dsn, name)  # blocks this loop: the connection has not read the notice
    return await raised(lambda: connection.fetchval("SELECT 1"))


async def known_closed(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    connection = await asyncpg.connect(dsn, server_settings={"application_name": name})
    terminate_backends(dsn, name)
    await eventually(connection.is_closed, message="the connection to see the termination")
    return await raised(lambda: connection.fetchval("SELECT 1"))


async def released_to_the_pool(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    pool = await asyncpg.create_pool(
        dsn, min_size=1, max_size=1, server_settings={"application_name": name}
    )
    try:
        async with pool.acquire() as connection:
            terminate_backends(dsn, name)
            await eventually(lambda: pool.get_idle_size() == 1, message="the pool to take it back")
            return await raised(lambda: connection.fetchval("SELECT 1"))
    finally:
        await pool.close()


async def notice_read_end_not_yet(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    parts = urlsplit(dsn)
    async with LinkProxy(parts.port or 5432, parts.hostname or "127.0.0.1") as link:
        link.keep_ends()
        connection = await asyncpg.connect(
            link.proxied(dsn), server_settings={"application_name": name}
        )
        await terminate_with_notices_read(dsn, name, link, [connection])
        return await raised(lambda: connection.fetchval("SELECT 1"))  # refused: nothing sent


async def reset_after_the_reply(dsn: str, name: str, proxy: CuttingProxy) -> BaseException:
    connection = await asyncpg.connect(proxy.proxied(dsn))
    await connection.fetchval("SELECT 1")
    proxy.arm("reply")
    return await raised(lambda: connection.fetchval("SELECT 1"))  # the connection is gone


async def an_error_of_the_statement(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    connection = await asyncpg.connect(dsn)
    try:
        return await raised(lambda: connection.fetchval("SELECT 1 / 0"))
    finally:
        await connection.close()


async def a_closed_pool(dsn: str, name: str, _: CuttingProxy) -> BaseException:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    await pool.close()
    return await raised(lambda: pool.fetchval("SELECT 1"))


SCENARIOS = [
    (terminated_while_idle, True, "ConnectionDoesNotExistError", "57P01"),
    (terminated_while_running, True, "ConnectionDoesNotExistError", "57P01"),
    (idle_session_timeout, True, "ConnectionDoesNotExistError", "57P05"),
    (known_closed, True, "InterfaceError", None),
    (released_to_the_pool, True, "InterfaceError", None),
    (notice_read_end_not_yet, True, "InternalClientError", None),
    (reset_after_the_reply, False, "ConnectionDoesNotExistError", None),
    (an_error_of_the_statement, False, "DivisionByZeroError", None),
    (a_closed_pool, False, "InterfaceError", None),
]


@pytest.mark.parametrize(
    ("scenario", "never_ran", "error", "notice"), SCENARIOS, ids=[s[0].__name__ for s in SCENARIOS]
)
async def test_classification_of_real_failures(
    scenario: Callable[[str, str, CuttingProxy], Awaitable[BaseException]],
    never_ran: bool,
    error: str,
    notice: str | None,
    postgres_dsn: str,
    application_name: str,
    proxy: CuttingProxy,
) -> None:
    exc = await scenario(postgres_dsn, application_name, proxy)
    assert type(exc).__name__ == error
    cause = exc.__cause__
    assert getattr(cause, "sqlstate", None) == notice
    assert statement_never_ran(exc) is never_ran


async def test_a_connection_asyncpg_closed_counts_as_ended(
    postgres_dsn: str, application_name: str
) -> None:
    """Closed by the client, or its end read: its socket is gone, and was taken for alive."""
    closed = await asyncpg.connect(postgres_dsn)
    await closed.close()
    ended = await asyncpg.connect(
        postgres_dsn, server_settings={"application_name": application_name}
    )
    terminate_backends(postgres_dsn, application_name)
    await eventually(ended.is_closed, message="the connection to see the termination")
    assert ended_while_idle(closed)
    assert ended_while_idle(ended)


@pytest.mark.parametrize(
    "message",
    [
        'cannot switch to "idle" state; protocol is in the "failed" state',
        "cannot process message 'D': protocol is in an unexpected state 0.",
        "unknown error in protocol implementation",
    ],
)
def test_a_protocol_error_while_a_reply_is_read_is_not_certain(message: str) -> None:
    """asyncpg raises these as it reads a reply: the statement went out."""
    assert not statement_never_ran(asyncpg.InternalClientError(message))


async def test_immediate_shutdown_mid_statement_is_not_certain(
    private_postgres: PostgresServer,
) -> None:
    """``pg_ctl stop -m immediate`` says 57P01 too, but as a WARNING the backend can send at
    any moment, after a commit included; asyncpg raises no server error for it."""
    holder = await asyncpg.connect(private_postgres.dsn)
    victim = await asyncpg.connect(private_postgres.dsn, server_settings={"application_name": "v"})
    await holder.execute("SELECT pg_advisory_lock(4242)")
    waiting = asyncio.create_task(victim.execute("SELECT pg_advisory_lock(4242)"))
    await lock_waiter(holder, "v")
    await asyncio.to_thread(private_postgres.stop, mode="immediate")
    exc = await raised(lambda: waiting)
    assert isinstance(exc, asyncpg.ConnectionDoesNotExistError)
    assert exc.__cause__ is None
    assert not statement_never_ran(exc)
