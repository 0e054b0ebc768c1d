"""Idempotency records to arrange a store with: a held lock and its final states."""

from __future__ import annotations

import time

from starlette_idempotency import StoredResponse
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus

#: The lock and retention TTLs the store tests arrange and write records with.
LOCK_TTL = 30.0
RETENTION_TTL = 60.0


def pending(
    key: str,
    owner_token: str = "owner-a",
    *,
    fingerprint: str = "sha256:abc",
    lock_ttl: float = LOCK_TTL,
    now: float | None = None,
) -> IdempotencyRecord:
    """An ``InProgress`` record held by ``owner_token`` for ``lock_ttl`` seconds from ``now``
    (the wall clock unless given: what real-time backends measure with)."""
    start = time.time() if now is None else now
    return IdempotencyRecord(
        key=key,
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint=fingerprint,
        owner_token=owner_token,
        created_at=start,
        expires_at=start + lock_ttl,
    )


def finished(
    record: IdempotencyRecord,
    *,
    status: RecordStatus = RecordStatus.COMPLETED,
    body: bytes = b'{"ok": true}',
    ttl: float = RETENTION_TTL,
) -> IdempotencyRecord:
    """``record`` moved to a final state with a small JSON response."""
    response = StoredResponse(
        status_code=201,
        headers=(("content-type", "application/json"), ("x-request", "1")),
        body=body,
        content_type="application/json",
    )
    return record.finished(status, response, record.created_at + ttl)
