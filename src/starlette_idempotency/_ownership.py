"""The life of a key this request owns: run the app, renew the lock, keep recovery points,
then settle the outcome (store it, or release the key).

An :class:`OwnedKey` exists only once the store said the key is this request's, so its record
is always there. Every write it makes is fenced by the record's owner token; a write that finds
the key taken over or gone is reported as ``LOCK_LOST``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import anyio

from starlette_idempotency._capture import ReplayingReceive, ResponseCapture
from starlette_idempotency._context import CONTEXT_SCOPE_KEY, IdempotencyContext
from starlette_idempotency._marks import MARKS_SCOPE_KEY, RequestMarks, current_marks
from starlette_idempotency._protection import ResponseKeeper
from starlette_idempotency._record import Checkpoint, IdempotencyRecord, RecordStatus
from starlette_idempotency._routing import GuardedRoute
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency._timers import HeldLock, LockRenewal, Renewals
from starlette_idempotency._types import ASGIApp, Clock, Receive, Scope, Send
from starlette_idempotency.errors import (
    ConfigurationError,
    IdempotencyError,
    LockLostError,
    StoreError,
)
from starlette_idempotency.observability import OutcomeResult, RequestEvents
from starlette_idempotency.stores.base import FencedWrite

logger = logging.getLogger(__name__)

# Statuses that say "try again" rather than "this is the outcome": the key is released.
_TRANSIENT_STATUSES = frozenset({408, 429})
# Without the decorator's start mark, these are what a step before the endpoint produces
# (request validation, authentication), so they release the key instead of being stored.
_PRE_ENDPOINT_STATUSES = frozenset({401, 403, 422})
# Response extensions whose body bypasses http.response.body and so could not be stored.
_UNCAPTURABLE_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


class OwnedKey:
    """A key this request owns, from the acquire until its outcome is settled."""

    __slots__ = (
        "_clock",
        "_decided",
        "_events",
        "_marks",
        "_responses",
        "_route",
        "_store",
        "_store_key",
        "record",
        "renewal",
    )

    def __init__(
        self,
        *,
        store: BoundedStore,
        clock: Clock,
        events: RequestEvents,
        route: GuardedRoute,
        store_key: str,
        record: IdempotencyRecord,
        responses: ResponseKeeper,
    ) -> None:
        self._store = store
        self._responses = responses
        self._clock = clock
        self._events = events
        self._route = route
        self._store_key = store_key
        self._marks = RequestMarks()
        #: The record as this request last wrote it (its checkpoints and owner token; its
        #: lease is the store's to keep).
        self.record = record
        self.renewal: LockRenewal | None = None
        # Set once the outcome is being stored or the key freed: no recovery point after it.
        self._decided = False

    async def run(
        self,
        app: ASGIApp,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        renewals: Renewals,
    ) -> None:
        """Run the app as the key's owner and settle the outcome before the response ends."""
        policy = self._route.policy
        scope = _scope_for_app(scope)
        marks = self._marks
        scope[MARKS_SCOPE_KEY] = marks
        scope[CONTEXT_SCOPE_KEY] = IdempotencyContext(
            self.record.key, self.record.checkpoints, self.checkpoint
        )
        capture = ResponseCapture(send, self, policy.max_response_bytes)
        renewal = None
        if policy.renew_lock:
            lock = HeldLock(
                self._store_key,
                self.record.owner_token,
                policy.lock_ttl_seconds,
                self._events.endpoint,
            )
            renewal = LockRenewal(self.renew, self._events, lock, renewals)
        self.renewal = renewal
        token = current_marks.set(marks)
        try:
            await app(scope, ReplayingReceive(body, receive), capture)
        finally:
            current_marks.reset(token)
            # The context refers back to this object, which the scope holds: break the cycle,
            # or every request would leave its whole scope to the garbage collector.
            scope.pop(CONTEXT_SCOPE_KEY, None)
            if renewal is not None:
                renewal.stop()
                # It holds this object's bound renew(): no reference cycle left to the collector.
                self.renewal = None
            if not capture.settled:
                # Shielded, so a cancelled request still settles or frees its key.
                with anyio.CancelScope(shield=True):
                    await capture.settle_unfinished()

    async def checkpoint(self, name: str, data: Any) -> None:
        """Save a recovery point on the record (see ``checkpoint``)."""
        if not self._store.store.supports_recovery:
            raise ConfigurationError(
                f"{type(self._store.store).__name__} cannot keep recovery points: use "
                "RedisStore, PostgresStore or MemoryStore"
            )
        if self._decided:
            raise IdempotencyError(
                f"checkpoint({name!r}) came after the outcome of idempotency key "
                f"{self.record.key!r} was decided (its response stored, or its key freed): a "
                "recovery point can only be saved while the handler runs, before its response "
                "ends (not from a background task, which runs after it)"
            )
        policy = self._route.policy
        now = self._clock()
        record = replace(
            self.record,
            checkpoints=(*self.record.checkpoints, Checkpoint(name, data, now)),
            expires_at=now + policy.ttl_seconds,
        )
        await self._save_progress(record, policy.lock_ttl_seconds)

    async def _save_progress(self, record: IdempotencyRecord, lease: float) -> None:
        saved = await self._store.save_progress(
            self._store_key, record, self._route.policy.ttl_seconds, lease
        )
        if not saved:
            raise LockLostError(f"the lock for idempotency key {record.key!r} was taken over")
        self.record = record

    async def renew(self) -> bool:
        """Extend the lock (for a record with recovery points, its lease), taking the key back
        if it vanished; false once another request holds it (then there is nothing left to
        renew)."""
        policy = self._route.policy
        renewed = await self._store.renew(
            self._store_key, self.record, policy.lock_ttl_seconds, policy.ttl_seconds
        )
        return renewed or await self._reclaim()

    async def _reclaim(self) -> bool:
        """Take back the key with this request's own owner token if nobody holds it.

        The lock can vanish while its handler runs: evicted under ``maxmemory``, deleted by an
        operator, expired while the process was frozen. Until it is back, a retry could run
        the handler a second time, so it is taken back at once and reported as ``LOCK_LOST``.
        """
        policy = self._route.policy
        lock_ttl = policy.lock_ttl_seconds
        now = self._clock()
        # Held by the acquire's lock TTL, with no lease of its own until it is saved again.
        record = replace(self.record, locked_until=None, expires_at=now + lock_ttl)
        result = await self._store.try_acquire(self._store_key, record, lock_ttl, recover=False)
        if not result.acquired:
            logger.warning(
                "the lock for idempotency key %r was taken over by another request while its "
                "handler ran; its response will not be stored",
                self._events.shown_key,
            )
            await self._events.lock_lost("lock_lost", "taken_over")
            return False
        self.record = record
        if record.checkpoints:  # back to the retention time that keeps recovery points
            await self._save_progress(
                replace(record, expires_at=now + policy.ttl_seconds), lock_ttl
            )
        logger.warning(
            "the lock for idempotency key %r vanished while its handler ran (evicted, deleted, "
            "or expired while the process stalled) and was taken back; a retry in between may "
            "have run the handler again. Run Redis with maxmemory-policy noeviction",
            self._events.shown_key,
        )
        await self._events.lock_lost("renewal_found_gone", "reclaimed")
        return True

    async def settle(
        self, status: int, raw_headers: list[tuple[bytes, bytes]], chunks: list[bytes] | None
    ) -> None:
        """Store the response as the key's outcome, or release the key (5xx, 408, 429, a
        retryable mark, a status from before the endpoint)."""
        self._decided = True
        if self.renewal is not None:
            self.renewal.stop()  # a renewal now would find the record final, not the lock gone
        if not self._should_store(status):
            await self.release(status)
            return
        completed = status < 400
        policy = self._route.policy
        ttl = policy.ttl_seconds
        body = None if chunks is None else b"".join(chunks)
        kept, note = self._responses.keep(
            policy.stored_parts, self._store_key, status, raw_headers, body
        )
        record = self.record.finished(
            RecordStatus.COMPLETED if completed else RecordStatus.FAILED,
            kept,
            expires_at=self._clock() + ttl,
        )
        try:
            stored = await self._store.finish(self._store_key, record, ttl)
        except StoreError as exc:
            logger.error(
                "could not store the response for idempotency key %r; a retry is answered 409 "
                "until the lock expires and then runs again: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
            stored = FencedWrite.WRITTEN  # not lost to another owner: still this request's
        if not stored:
            logger.warning(
                "lock for idempotency key %r was lost to another request; its response was "
                "sent to this client but not stored",
                self._events.shown_key,
            )
            await self._events.lock_lost("lock_lost", "taken_over", status)
            return
        if stored == FencedWrite.RECLAIMED:
            logger.warning(
                "the lock for idempotency key %r had vanished before its response was stored "
                "(evicted, deleted, or expired while the process stalled); stored anyway, but a "
                "retry in between may have run the handler again",
                self._events.shown_key,
            )
            await self._events.lock_lost("complete_found_gone", "reclaimed", status)
        await self._events.ended(
            OutcomeResult.COMPLETED if completed else OutcomeResult.FAILED, status, note
        )

    def _should_store(self, status: int) -> bool:
        if self._marks.retryable or status >= 500 or status in _TRANSIENT_STATUSES:
            return False
        if self._route.marks_start:
            return self._marks.endpoint_started
        return status not in _PRE_ENDPOINT_STATUSES

    async def release(self, status: int | None) -> None:
        """Free the key for a retry (keeping its recovery points, if it has any)."""
        self._decided = True
        if self.record.checkpoints:
            # Recovery points mean a side effect may have happened: keep them for the retry.
            await self._keep_for_recovery(status)
            return
        try:
            released = await self._store.release(self._store_key, self.record.owner_token)
        except StoreError as exc:
            logger.error(
                "could not release idempotency key %r: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
            released = True
        if released:
            await self._events.ended(OutcomeResult.RELEASED, status)
        else:
            logger.warning(
                "lock for %r was taken over before it could be released", self._events.shown_key
            )
            await self._events.lock_lost("lock_lost", "taken_over", status)

    async def _keep_for_recovery(self, status: int | None) -> None:
        """End the lease now, keeping the checkpoints, so a retry recovers at once."""
        try:
            await self._save_progress(self.record, 0.0)
        except LockLostError:
            await self._events.lock_lost("lock_lost", "taken_over", status)
            return
        except StoreError as exc:
            logger.error(
                "could not end the lease of idempotency key %r: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
        await self._events.ended(OutcomeResult.RELEASED, status)


def _scope_for_app(scope: Scope) -> Scope:
    extensions = scope.get("extensions")
    if not extensions or _UNCAPTURABLE_EXTENSIONS.isdisjoint(extensions):
        return scope
    kept = {k: v for k, v in extensions.items() if k not in _UNCAPTURABLE_EXTENSIONS}
    return {**scope, "extensions": kept}
