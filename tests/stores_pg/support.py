"""Records and row arrangements shared by the PostgresStore tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette_idempotency.record import IdempotencyRecord, RecordStatus, StoredResponse

LOCK_TTL = 30.0
TTL = 3600.0


def pending(
    owner: str, key: str = "client-key", fingerprint: str = "sha256:aa"
) -> IdempotencyRecord:
    return IdempotencyRecord(
        key=key,
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint=fingerprint,
        owner_token=owner,
        created_at=time.time(),
        expires_at=time.time() + LOCK_TTL,
    )


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


async def deadline_in(sql: Any, table: str, key: str) -> float:
    """Seconds until the row's expiry (the database's deadline, not the record's field)."""
    seconds = await sql.fetchval(
        f"SELECT extract(epoch FROM expires_at - now())::float8 FROM {table} WHERE key = $1",
        f"idempotency:{key}",
    )
    assert seconds is not None
    return float(seconds)


async def lock_waiter(watcher: Any, name: str) -> int:
    """The pid of the connection named ``name``, once it waits for a lock."""
    query = (
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'"
    )
    async with asyncio.timeout(10):
        pid = await watcher.fetchval(query, name)
        while pid is None:  # polls the server: no event to wait on
            await asyncio.sleep(0.01)
            pid = await watcher.fetchval(query, name)
    return int(pid)
