"""The part of a store's check that does what a request does: an acquire, the outcome's write
and a release, on a key of the check's own under the store's prefix.

Reaching the server says little about whether it lets the store work. A Redis ACL without
``EVALSHA`` acquires (``SET NX``) and then refuses every outcome's write, so each retry runs
the handler again once the lock lapses; a PostgreSQL role without ``UPDATE``, or a table
without its primary key, fails every request. Only doing it finds these.

Once it has worked, a store does not do it again until an operation a request makes fails
(:class:`RoundTrip`): a readiness probe stays as cheap as it was while the store works, not
three round trips more on every probe of every pod, and a store that stopped working for
requests (a Redis primary demoted to a replica, a revoked grant) is not ready again until the
round trip works.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextvars import ContextVar

from starlette_idempotency._record import IdempotencyRecord, RecordStatus, StoredResponse
from starlette_idempotency.stores.base import IdempotencyStore, StoreFinding

#: How long the three calls may take together.
ROUND_TRIP_TIMEOUT_SECONDS = 2.0
#: How long the check's record lives if the check is cut short before its release.
_CHECK_TTL_SECONDS = 10.0
_CHECK_KEY = "__idempotency_check__"

#: Set while a store does the check's round trip: a store may leave out what asks nothing of
#: its permissions and only takes time (``RedisStore``'s wait for its replicas).
IN_ROUND_TRIP: ContextVar[bool] = ContextVar("IN_ROUND_TRIP", default=False)


#: The operations a request makes: one that fails says requests may fail the same way (a
#: failed operation claim, purge or listing does not, and would otherwise have every probe run
#: the round trip for as long as it fails).
_REQUEST_OPERATIONS = frozenset(
    {"try_acquire", "finish", "save_progress", "release", "renew", "get"}
)


class RoundTrip:
    """A store's round trip, until it has worked, and again once an operation a request makes
    has failed (see :meth:`failed`)."""

    __slots__ = ("_advice", "_store", "_timeout", "worked")

    def __init__(self, store: IdempotencyStore, advice: str, timeout: float) -> None:
        self._store = store
        self._advice = advice
        self._timeout = timeout
        self.worked = False

    def failed(self, operation: str) -> None:
        """The store's ``operation`` failed: if a request makes it, the next check runs the
        round trip again."""
        if operation in _REQUEST_OPERATIONS:
            self.worked = False

    async def finding(self, where: str) -> StoreFinding | None:
        """An ``error`` when the store (at ``where``) refuses or fails what every request
        sends, ending with the advice; ``None`` once it has worked."""
        if self.worked:
            return None
        cause = await _failure(self._store, self._timeout)
        self.worked = cause is None
        if cause is None:
            return None
        return StoreFinding(
            "error",
            f"{where} refuses what every request does (an acquire, the outcome's write and a "
            f"release, tried on a key of the check's own): {cause}. {self._advice}",
        )


async def _failure(
    store: IdempotencyStore,
    timeout: float,  # noqa: ASYNC109 - no answer is a failure to report, not to raise
) -> str | None:
    """What went wrong when ``store`` acquired, finished and released a key of its own
    within ``timeout`` seconds; ``None`` when nothing did."""
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
    marked = IN_ROUND_TRIP.set(True)
    try:
        async with asyncio.timeout(timeout):
            await store.try_acquire(key, pending, _CHECK_TTL_SECONDS, recover=False)
            await store.finish(key, finished, _CHECK_TTL_SECONDS)
            await store.release(key, token)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except Exception as exc:  # a check reports what went wrong, whatever it is
        return str(exc).strip() or type(exc).__name__
    finally:
        IN_ROUND_TRIP.reset(marked)
    return None
