"""The part of a store's check that does what a request does: an acquire, the outcome's write
and a release, on a key of the check's own under the store's prefix.

Reaching the server says little about whether it lets the store work. A Redis ACL without
``EVALSHA`` acquires (``SET NX``) and then refuses every outcome's write, so each retry runs
the handler again once the lock lapses; a PostgreSQL role without ``UPDATE``, or a table
without its primary key, fails every request. Only doing it finds these.
"""

from __future__ import annotations

import asyncio
import os
import time

from starlette_idempotency._record import IdempotencyRecord, RecordStatus, StoredResponse
from starlette_idempotency.stores.base import IdempotencyStore, StoreFinding

#: How long the three calls may take together.
ROUND_TRIP_TIMEOUT_SECONDS = 2.0
#: How long the check's record lives if the check is cut short before its release.
_CHECK_TTL_SECONDS = 10.0
_CHECK_KEY = "__idempotency_check__"


async def refused_round_trip(
    store: IdempotencyStore, where: str, advice: str
) -> StoreFinding | None:
    """An ``error`` when ``store`` (at ``where``) refuses or fails what every request sends,
    ending with ``advice``; ``None`` when the acquire, the write and the release all went
    through."""
    token = os.urandom(16).hex()
    key = f"{_CHECK_KEY}:{token}"
    now = time.time()
    pending = IdempotencyRecord(
        key=key,
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint="check",
        owner_token=token,
        created_at=now,
        expires_at=now + _CHECK_TTL_SECONDS,
    )
    finished = pending.finished(
        RecordStatus.COMPLETED, StoredResponse(204, (), b""), now + _CHECK_TTL_SECONDS
    )
    try:
        async with asyncio.timeout(ROUND_TRIP_TIMEOUT_SECONDS):
            await store.try_acquire(key, pending, _CHECK_TTL_SECONDS, recover=False)
            await store.finish(key, finished, _CHECK_TTL_SECONDS)
            await store.release(key, token)
    except TimeoutError:
        cause = f"no answer within {ROUND_TRIP_TIMEOUT_SECONDS:g} s"
    except Exception as exc:  # a check reports what went wrong, whatever it is
        cause = str(exc).strip() or type(exc).__name__
    else:
        return None
    return StoreFinding(
        "error",
        f"{where} refuses what every request does (an acquire, the outcome's write and a "
        f"release, tried on a key of the check's own): {cause}. {advice}",
    )
