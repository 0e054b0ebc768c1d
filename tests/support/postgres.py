"""PostgreSQL arrangements shared by the PostgresStore tests: records, row expiry on the
database clock, lock waiters, ending connections by name, and roles of restricted rights."""

from __future__ import annotations

import select
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from starlette_idempotency import StoredResponse
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._isolation import run_admin
from tests.support import records
from tests.support.conditions import eventually, eventually_sync
from tests.support.link_proxy import LinkProxy

LOCK_TTL = 30.0
TTL = 3600.0


def pending(
    owner: str, key: str = "client-key", fingerprint: str = "sha256:aa"
) -> IdempotencyRecord:
    return records.pending(key, owner, fingerprint=fingerprint, lock_ttl=LOCK_TTL)


def completed(record: IdempotencyRecord, body: bytes = b'{"ok":true}') -> IdempotencyRecord:
    response = StoredResponse(
        201, (("content-type", "application/json"),), body, "application/json"
    )
    return record.finished(RecordStatus.COMPLETED, response, record.expires_at)


async def expire(sql: Any, table: str, key: str) -> None:
    """Move a row's expiry into the past on the database clock (no sleeping)."""
    status = await sql.execute(
        f"UPDATE {table} SET expires_at = now() - interval '1 second' WHERE key = $1",
        f"idempotency:{key}",
    )
    assert status == "UPDATE 1"


async def lapsed_lock(
    store: PostgresStore, sql: Any, table: str, key: str, record: IdempotencyRecord
) -> None:
    """``key`` acquired with ``record``, then its row's expiry moved into the past: a lock that
    lapsed, its row still there."""
    await store.try_acquire(key, record, LOCK_TTL)
    await expire(sql, table, key)


async def deadline_in(sql: Any, table: str, key: str) -> float:
    """Seconds until the row's expiry (the database's deadline, not the record's field)."""
    seconds = await sql.fetchval(
        f"SELECT extract(epoch FROM expires_at - now())::float8 FROM {table} WHERE key = $1",
        f"idempotency:{key}",
    )
    assert seconds is not None
    return float(seconds)


@asynccontextmanager
async def rows_locked(sql: Any, table: str) -> AsyncIterator[None]:
    """Every row of ``table`` locked (``FOR UPDATE``) in a transaction of ``sql``'s while the
    block runs: a store statement that writes one of them waits until it ends."""
    async with sql.transaction():
        await sql.execute(f"SELECT 1 FROM {table} FOR UPDATE")
        yield


async def lock_waiter(watcher: Any, name: str) -> int:
    """The pid of the connection named ``name``, once it waits for a lock."""
    query = (
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'"
    )
    pid: int = await eventually(
        lambda: watcher.fetchval(query, name),
        timeout=10,
        message=f"the connection {name!r} to wait for a lock",
    )
    return pid


def terminate_backends(dsn: str, application_name: str) -> int:
    """``pg_terminate_backend`` every connection named ``application_name``, waiting until
    each backend has exited; returns how many there were.

    It blocks the calling thread, so when called from a test's event loop, that loop's pools
    have not yet read the termination notices when it returns: their next statement meets the
    dead connection, as does a request that arrives just as the server ends its connections
    (a restart, failover or ``idle_session_timeout``).
    """
    terminated: int = run_admin(
        dsn,
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
        "FROM pg_stat_activity WHERE application_name = $1",
        application_name,
    )
    return terminated


def wait_for_no_backends(dsn: str, application_name: str, timeout: float = 10.0) -> None:
    """Block until no connection named ``application_name`` is left (the server ended them,
    e.g. on ``idle_session_timeout``); like :func:`terminate_backends`, it blocks the caller's
    event loop, so the client side has not read the termination yet when it returns."""
    query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
    eventually_sync(
        lambda: run_admin(dsn, query, application_name) == 0,
        timeout=timeout,
        interval=0.05,
        message=f"the connections named {application_name!r} to end",
    )


@asynccontextmanager
async def a_role(sql: Any, dsn: str, role: str, *grants: str) -> AsyncIterator[str]:
    """The DSN of a new role ``role`` holding ``grants`` (each ``"SELECT ON table"``), for the
    block; ``dsn``'s server must let it log in without a password."""
    await sql.execute(f"CREATE ROLE {role} LOGIN")
    try:
        for grant in grants:
            await sql.execute(f"GRANT {grant} TO {role}")
        parts = urlsplit(dsn)
        yield urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))
    finally:
        await sql.execute(f"DROP OWNED BY {role}; DROP ROLE {role}")


def unread(connection: Any) -> bool:
    """Whether something the server sent waits on an asyncpg connection's socket, not yet read
    by the event loop."""
    sock = connection._transport.get_extra_info("socket")
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


async def terminate_with_notices_read(
    dsn: str, application_name: str, link: LinkProxy, connections: Iterable[Any]
) -> int:
    """:func:`terminate_backends` for connections behind ``link``, which keeps their ends back
    (:meth:`LinkProxy.keep_ends`), then wait until this event loop has read the termination
    notice of each of ``connections`` still open: they look alive, with nothing to read, but
    asyncpg's protocol took the notice, which came unasked, for a reply out of turn and is no
    longer idle. Returns how many were ended."""
    kept_ends = link.kept_ends
    ended = terminate_backends(dsn, application_name)

    def notices_read() -> bool:
        still_open = [connection for connection in connections if not connection.is_closed()]
        return link.kept_ends == kept_ends + ended and not any(map(unread, still_open))

    await eventually(notices_read, message="the termination notices to be read")
    return ended
