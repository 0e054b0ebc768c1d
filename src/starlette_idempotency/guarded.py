"""One guarded request's journey through the state machine.

Validate the key, buffer and fingerprint the body, acquire the key as ``InProgress``, run the
app as the key's owner, and settle the outcome before the last body chunk reaches the client
(complete, fail or release). A key already held answers with a replay, a 409 (or a wait for
the first request) or a 422 without running the app.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from starlette_idempotency._types import Message, Receive, Scope, Send
from starlette_idempotency.context import CONTEXT_SCOPE_KEY, IdempotencyContext
from starlette_idempotency.errors import ConfigurationError, LockLostError, StoreError
from starlette_idempotency.fingerprint import (
    raw_body_form,
    request_fingerprint,
    storage_key,
)
from starlette_idempotency.keys import InvalidKey, parse_key, sent_once_message
from starlette_idempotency.observability import CheckResult, OutcomeResult
from starlette_idempotency.policy import MARKS_SCOPE_KEY, RequestMarks, current_marks
from starlette_idempotency.record import Checkpoint, IdempotencyRecord, RecordStatus
from starlette_idempotency.renewal import LockRenewal
from starlette_idempotency.responses import (
    ALREADY_PROCESSED_MESSAGE,
    IN_PROGRESS_MESSAGE,
    MISMATCH_MESSAGE,
    STORE_UNAVAILABLE_MESSAGE,
    Problem,
    replay_for,
    retry_after_seconds,
    send_replay,
    send_requires_recovery,
    stored_response,
)
from starlette_idempotency.routing import GuardedRoute
from starlette_idempotency.stores.base import AcquireResult, FencedWrite

if TYPE_CHECKING:
    from starlette_idempotency.middleware import IdempotencyMiddleware

logger = logging.getLogger(__name__)

# Statuses that say "try again" rather than "this is the outcome": the key is released.
_TRANSIENT_STATUSES = frozenset({408, 429})
# Without the decorator's start mark, these are what a step before the endpoint produces
# (request validation, authentication), so they release the key instead of being stored.
_PRE_ENDPOINT_STATUSES = frozenset({401, 403, 422})
# A Content-Length that is not one decimal number (RFC 9110 calls the request malformed).
_INVALID_LENGTH = -1
# Response extensions whose body bypasses http.response.body and so could not be stored.
_UNCAPTURABLE_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


class GuardedRequest:
    """One guarded request's journey through the state machine."""

    __slots__ = (
        "chosen_headers",
        "content_length",
        "content_type",
        "key",
        "mw",
        "policy",
        "receive",
        "record",
        "renewal",
        "route",
        "scope",
        "send",
        "started",
        "store_key",
    )

    def __init__(
        self,
        middleware: IdempotencyMiddleware,
        route: GuardedRoute,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self.mw = middleware
        self.route = route
        self.policy = route.policy
        self.scope = scope
        self.receive = receive
        self.send = send
        self.key: str | None = None
        self.started = time.perf_counter()
        self.content_length: int | None = None
        self.content_type = ""
        self.chosen_headers: list[tuple[str, str]] = []
        self.store_key = ""
        self.record: IdempotencyRecord  # set once the key is owned
        self.renewal: LockRenewal | None = None

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    async def _decided(self, result: CheckResult, note: str | None = None) -> None:
        if not self.mw.observer.wants_events:
            return
        await self.mw.observer.emit(
            "idempotency_check",
            key=self.key,
            endpoint=self._endpoint(),
            result=result,
            duration_ms=self._elapsed_ms(),
            note=note,
        )

    async def _ended(
        self, result: OutcomeResult, status_code: int | None, note: str | None = None
    ) -> None:
        if not self.mw.observer.wants_events:
            return
        await self.mw.observer.emit(
            "idempotency_outcome",
            key=self.key,
            endpoint=self._endpoint(),
            result=result,
            duration_ms=self._elapsed_ms(),
            status_code=status_code,
            note=note,
        )

    async def _lock_lost(self, reason: str, note: str, status_code: int | None = None) -> None:
        """Report a lock that vanished or was taken over: a ``LOCK_LOST`` outcome event with
        ``note`` ("reclaimed" or "taken_over") and a processing timeout counted as ``reason``."""
        self.mw.observer.processing_timeout(self._endpoint(), reason)
        await self._ended(OutcomeResult.LOCK_LOST, status_code, note)

    def _endpoint(self) -> str:
        return f"{self.scope['method']} {self.route.template}"

    async def _reject(
        self,
        problem: Problem,
        detail: str,
        result: CheckResult,
        *,
        retry_after: int | None = None,
        note: str | None = None,
        location: str | None = None,
    ) -> None:
        await self._decided(result, note)
        await self.mw._errors.send(
            self.send,
            problem,
            detail,
            retry_after=retry_after,
            location=location,
            request_headers=self.scope["headers"],
        )

    async def run(self) -> None:
        mw = self.mw
        # One pass over the headers for everything the request needs from them.
        raw_keys: list[bytes] = []
        wanted = self.policy.fingerprint_header_names
        for name, value in self.scope["headers"]:
            if name == mw._header_bytes:
                raw_keys.append(value)
            elif name == b"content-length":
                length = int(value) if value.isdigit() else _INVALID_LENGTH
                if self.content_length not in (None, length):
                    length = _INVALID_LENGTH  # two Content-Length headers that disagree
                self.content_length = length
            elif name == b"content-type" and not self.content_type:
                self.content_type = value.decode("latin-1")
            if name in wanted:
                self.chosen_headers.append((name.decode("latin-1"), value.decode("latin-1")))
        if not raw_keys:
            if self.policy.required:
                await self._reject(
                    Problem.MISSING_KEY,
                    f"{mw.header_name} header is required",
                    CheckResult.MISSING_KEY,
                )
            else:
                await self._decided(CheckResult.MISSING_KEY)
                await mw.app(self.scope, self.receive, self.send)
            return
        key = (
            parse_key(raw_keys[0], header_name=mw.header_name, max_length=mw._max_key_length)
            if len(raw_keys) == 1
            else InvalidKey(sent_once_message(mw.header_name))
        )
        if isinstance(key, InvalidKey):
            await self._reject(Problem.INVALID_KEY, key.message, CheckResult.INVALID_KEY)
            return
        self.key = key
        body = await self._read_body()
        if body is None:
            return
        await self._guard(key, body)

    async def _read_body(self) -> bytes | None:
        """The whole request body, or ``None`` once an answer was sent (413) or the client left."""
        limit = self.mw._max_body_bytes
        if self.content_length == _INVALID_LENGTH:
            await self._reject(
                Problem.INVALID_REQUEST,
                "Content-Length must be one decimal number",
                CheckResult.INVALID_REQUEST,
            )
            return None
        if self.content_length is not None and self.content_length > limit:
            await self._body_too_large()
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._body_too_large()
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _body_too_large(self) -> None:
        await self._reject(
            Problem.BODY_TOO_LARGE,
            f"Request body exceeds the {self.mw._max_body_bytes}-byte limit "
            "for idempotent requests",
            CheckResult.TOO_LARGE,
        )

    def _fingerprint(self, body: bytes) -> str | None:
        """The request's fingerprint; ``None`` when ``fingerprint="validated"`` finds the body
        is not a valid command."""
        scope = self.scope
        command = self.route.command
        if command is None:
            kind, canonical = raw_body_form(
                body, content_type=self.content_type, excluded=self.policy.excluded_field_names
            )
        else:
            form = command.canonical(body, self.content_type)
            if form is None:
                return None
            kind, canonical = form
        return request_fingerprint(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=self.chosen_headers,
            body_kind=kind,
            body=canonical,
        )

    async def _guard(self, key: str, body: bytes) -> None:
        mw, policy = self.mw, self.policy
        fingerprint = self._fingerprint(body)
        if fingerprint is None:
            await self._pass_invalid_command(body)
            return
        self.store_key = storage_key(
            await mw.scope_id(self.scope), self.scope["method"], self.route.template, key
        )
        now = mw._clock()
        pending = IdempotencyRecord(
            key=key,
            status=RecordStatus.IN_PROGRESS,
            request_fingerprint=fingerprint,
            owner_token=secrets.token_hex(16),
            created_at=now,
            expires_at=now + policy.lock_ttl_seconds,
            fingerprint_version=self.route.fingerprint_version,
        )
        try:
            acquired = await self._try_acquire(pending)
        except StoreError as exc:
            await self._on_store_down(exc, body)
            return
        if not acquired.acquired:
            assert acquired.record is not None
            if self._is_waitable(acquired.record, fingerprint):
                after_wait = await self._wait_for_first(pending)
                if after_wait is None:
                    return
                acquired = after_wait
            if not acquired.acquired:
                assert acquired.record is not None
                await self._answer_existing(acquired.record, fingerprint)
                return
        await self._run_owned(pending, acquired.record, body)

    def _try_acquire(self, pending: IdempotencyRecord) -> Awaitable[AcquireResult]:
        store, lock_ttl = self.mw.store, self.policy.lock_ttl_seconds
        if self.policy.on_recovery == "hold":
            acquire = functools.partial(store.try_acquire, recover=False)
            return self.mw.call_store(acquire, self.store_key, pending, lock_ttl)
        return self.mw.call_store(store.try_acquire, self.store_key, pending, lock_ttl)

    def _same_request(self, record: IdempotencyRecord, fingerprint: str) -> tuple[bool, str | None]:
        """Whether ``record`` was made by this same request, and a note for the event."""
        if record.fingerprint_version != self.route.fingerprint_version:
            # Fingerprinted under another scheme or route version (a deploy in between):
            # comparing the two would be meaningless, so the policy decides.
            return self.policy.on_fingerprint_change == "replay", "fingerprint_version_changed"
        return record.request_fingerprint == fingerprint, None

    def _is_waitable(self, record: IdempotencyRecord, fingerprint: str) -> bool:
        return (
            self.policy.on_in_progress == "wait"
            and record.status is RecordStatus.IN_PROGRESS
            and not record.lease_expired(self.mw._clock())
            and self._same_request(record, fingerprint)[0]
        )

    async def _wait_for_first(self, pending: IdempotencyRecord) -> AcquireResult | None:
        """Wait for the request holding the key to finish, then try again.

        Returns the final acquire result, or ``None`` once this request has been answered
        (409 when the wait timed out or too many requests already wait).
        """
        mw = self.mw
        deadline = time.monotonic() + self.policy.wait_timeout_seconds
        result: AcquireResult | None = None
        async with mw.waiters.waiting(self.store_key) as watch:
            if watch is None:
                await self._reject_in_progress(None, note="too_many_waiters")
                return None
            while (remaining := deadline - time.monotonic()) > 0:
                changed, record = await watch.changed(remaining)
                if not changed:
                    break
                if record is not None:
                    if record.status is not RecordStatus.IN_PROGRESS:
                        return AcquireResult(acquired=False, record=record)
                    continue  # another request took the key over: wait for it instead
                try:
                    result = await self._try_acquire(pending)  # the key is free: take it
                except StoreError:
                    continue  # the store hiccupped: keep waiting until the deadline
                if result.acquired or result.record is None:
                    return result
                if result.record.status is not RecordStatus.IN_PROGRESS:
                    return result
        await self._reject_in_progress(result.record if result else None, note="wait_timed_out")
        return None

    async def _pass_invalid_command(self, body: bytes) -> None:
        """Let the app answer an invalid body with its own 422, without touching the store.

        Should the endpoint start anyway (the app accepted what its own model rejects), the
        start mark refuses to run it unprotected.
        """
        await self._decided(CheckResult.INVALID_BODY)
        marks = RequestMarks()
        marks.must_not_start = True
        scope = self.scope
        scope[MARKS_SCOPE_KEY] = marks
        token = current_marks.set(marks)
        try:
            await self.mw.app(scope, _ReplayingReceive(body, self.receive), self.send)
        finally:
            current_marks.reset(token)

    async def _on_store_down(self, exc: StoreError, body: bytes) -> None:
        if self.policy.on_store_error == "fail_open":
            logger.warning(
                "idempotency store unavailable, running %s unprotected (fail_open): %s",
                self._endpoint(),
                exc,
            )
            await self._decided(CheckResult.FAIL_OPEN)
            await self.mw.app(self.scope, _ReplayingReceive(body, self.receive), self.send)
            return
        logger.error("idempotency store unavailable, answering 503: %s", exc)
        await self._reject(
            Problem.STORE_UNAVAILABLE,
            STORE_UNAVAILABLE_MESSAGE,
            CheckResult.STORE_ERROR,
            retry_after=1,
        )

    async def _reject_in_progress(
        self, record: IdempotencyRecord | None, note: str | None = None
    ) -> None:
        await self._reject(
            Problem.IN_PROGRESS,
            IN_PROGRESS_MESSAGE,
            CheckResult.CONFLICT,
            retry_after=retry_after_seconds(record, self.mw._clock()),
            note=note,
        )

    async def _answer_existing(self, record: IdempotencyRecord, fingerprint: str) -> None:
        same_request, note = self._same_request(record, fingerprint)
        if not same_request:
            await self._reject(Problem.MISMATCH, MISMATCH_MESSAGE, CheckResult.MISMATCH, note=note)
        elif record.lease_expired(self.mw._clock()):
            # on_recovery="hold": a handler checkpointed and died; nobody may run it again
            # until an operator or a reconciler resolves the record.
            await self._decided(CheckResult.REQUIRES_RECOVERY, note=note)
            await send_requires_recovery(self.send, record.checkpoints[-1].name)
        elif record.status is RecordStatus.IN_PROGRESS or record.response is None:
            await self._reject_in_progress(record, note)
        elif self.policy.replay == "reject":
            await self._reject(
                Problem.ALREADY_PROCESSED,
                ALREADY_PROCESSED_MESSAGE,
                CheckResult.REPLAYED,
                note="replay_rejected",
                location=record.response.header("location"),
            )
        else:
            await self._decided(CheckResult.REPLAYED, note=note)
            await send_replay(self.send, replay_for(record.response, self.scope["headers"]))

    async def _run_owned(
        self, pending: IdempotencyRecord, taken_over: IdempotencyRecord | None, body: bytes
    ) -> None:
        """Run the app as the key's owner and settle the outcome before the response ends."""
        mw, policy = self.mw, self.policy
        self.record = pending
        if taken_over is not None and taken_over.status is RecordStatus.IN_PROGRESS:
            mw.observer.processing_timeout(self._endpoint(), "expired_lease_taken_over")
            if taken_over.checkpoints:
                # The store kept the dead handler's recovery points under our token.
                self.record = replace(
                    taken_over,
                    owner_token=pending.owner_token,
                    locked_until=pending.expires_at,
                    expires_at=mw._clock() + policy.ttl_seconds,
                )
        await self._decided(
            CheckResult.ACQUIRED, note="recovering" if self.record.checkpoints else None
        )
        scope = self._scope_for_app()
        marks = RequestMarks()
        scope[MARKS_SCOPE_KEY] = marks
        scope[CONTEXT_SCOPE_KEY] = IdempotencyContext(
            self.record.key, self.record.checkpoints, self._checkpoint
        )
        capture = _ResponseCapture(self, marks)
        renewal = self.renewal = LockRenewal(self, mw.renewal_timers) if policy.renew_lock else None
        token = current_marks.set(marks)
        try:
            await mw.app(scope, _ReplayingReceive(body, self.receive), capture)
        finally:
            current_marks.reset(token)
            # The context refers back to this request, which refers to the scope: break the
            # cycle, or every request would leave its whole scope to the garbage collector.
            scope.pop(CONTEXT_SCOPE_KEY, None)
            if renewal is not None:
                renewal.stop()
            if not capture.settled:
                # Shielded, so a cancelled request still settles or frees its key.
                with anyio.CancelScope(shield=True):
                    await capture.settle_unfinished()

    async def _checkpoint(self, name: str, data: Any) -> None:
        """Save a recovery point on the record this request owns (see ``checkpoint``)."""
        mw, policy = self.mw, self.policy
        if not getattr(mw.store, "supports_recovery", False):
            raise ConfigurationError(
                f"{type(mw.store).__name__} cannot keep recovery points: use "
                "RedisStore, PostgresStore or MemoryStore"
            )
        now = mw._clock()
        record = replace(
            self.record,
            checkpoints=(*self.record.checkpoints, Checkpoint(name, data, now)),
            locked_until=now + policy.lock_ttl_seconds,
            expires_at=now + policy.ttl_seconds,
        )
        await self._save_progress(record)

    async def _save_progress(self, record: IdempotencyRecord) -> None:
        saved = await self.mw.call_store(
            self.mw.store.save_progress, self.store_key, record, self.policy.ttl_seconds
        )
        if not saved:
            raise LockLostError(f"the lock for idempotency key {record.key!r} was taken over")
        self.record = record

    async def renew_lock(self) -> bool:
        """Extend this request's lock, taking the key back if it vanished; false once another
        request holds it (then there is nothing left to renew)."""
        if not self.record.checkpoints:
            renewed = await self.mw.call_store(
                self.mw.store.renew,
                self.store_key,
                self.record.owner_token,
                self.policy.lock_ttl_seconds,
            )
        else:
            # A checkpointed record keeps its lease inside its value.
            lease = self.mw._clock() + self.policy.lock_ttl_seconds
            try:
                await self._save_progress(replace(self.record, locked_until=lease))
                renewed = True
            except LockLostError:
                renewed = False
        return renewed or await self._reclaim()

    async def _reclaim(self) -> bool:
        """Take back the key with this request's own owner token if nobody holds it.

        The lock can vanish while its handler runs: evicted under ``maxmemory``, deleted by an
        operator, expired while the process was frozen. Until it is back, a retry could run
        the handler a second time, so it is taken back at once and reported as ``LOCK_LOST``.
        """
        mw, lock_ttl = self.mw, self.policy.lock_ttl_seconds
        now = mw._clock()
        if self.record.checkpoints:
            record = replace(self.record, locked_until=now + lock_ttl)
        else:
            record = replace(self.record, expires_at=now + lock_ttl)
        acquire = functools.partial(mw.store.try_acquire, recover=False)
        result = await mw.call_store(acquire, self.store_key, record, lock_ttl)
        if not result.acquired:
            logger.warning(
                "the lock for idempotency key %r was taken over by another request while its "
                "handler ran; its response will not be stored",
                self.key,
            )
            await self._lock_lost("lock_lost", "taken_over")
            return False
        self.record = record
        if record.checkpoints:  # back to the retention time that keeps recovery points
            await self._save_progress(replace(record, expires_at=now + self.policy.ttl_seconds))
        logger.warning(
            "the lock for idempotency key %r vanished while its handler ran (evicted, deleted, "
            "or expired while the process stalled) and was taken back; a retry in between may "
            "have run the handler again. Run Redis with maxmemory-policy noeviction",
            self.key,
        )
        await self._lock_lost("renewal_found_gone", "reclaimed")
        return True

    def _scope_for_app(self) -> Scope:
        extensions = self.scope.get("extensions")
        if not extensions or _UNCAPTURABLE_EXTENSIONS.isdisjoint(extensions):
            return self.scope
        kept = {k: v for k, v in extensions.items() if k not in _UNCAPTURABLE_EXTENSIONS}
        return {**self.scope, "extensions": kept}

    async def _settle(
        self,
        marks: RequestMarks,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        chunks: list[bytes] | None,
    ) -> None:
        if self.renewal is not None:
            self.renewal.stop()  # a renewal now would find the record final, not the lock gone
        if not self._should_store(marks, status):
            await self._release(status)
            return
        completed = status < 400
        record = self.record.finished(
            RecordStatus.COMPLETED if completed else RecordStatus.FAILED,
            stored_response(status, raw_headers, None if chunks is None else b"".join(chunks)),
            expires_at=self.mw._clock() + self.policy.ttl_seconds,
        )
        store = self.mw.store
        try:
            stored = await self.mw.call_store(
                store.complete if completed else store.fail,
                self.store_key,
                record,
                self.policy.ttl_seconds,
            )
        except StoreError as exc:
            logger.error(
                "could not store the response for idempotency key %r; a retry is answered 409 "
                "until the lock expires and then runs again: %s",
                self.key,
                exc,
            )
            stored = FencedWrite.WRITTEN  # not lost to another owner: still this request's
        if not stored:
            logger.warning(
                "lock for idempotency key %r was lost to another request; its response was "
                "sent to this client but not stored",
                self.key,
            )
            await self._lock_lost("lock_lost", "taken_over", status)
            return
        if stored == FencedWrite.RECLAIMED:
            logger.warning(
                "the lock for idempotency key %r had vanished before its response was stored "
                "(evicted, deleted, or expired while the process stalled); stored anyway, but a "
                "retry in between may have run the handler again",
                self.key,
            )
            await self._lock_lost("complete_found_gone", "reclaimed", status)
        await self._ended(OutcomeResult.COMPLETED if completed else OutcomeResult.FAILED, status)

    def _should_store(self, marks: RequestMarks, status: int) -> bool:
        if marks.retryable or status >= 500 or status in _TRANSIENT_STATUSES:
            return False
        if self.route.marks_start:
            return marks.endpoint_started
        return status not in _PRE_ENDPOINT_STATUSES

    async def _release(self, status: int | None) -> None:
        if self.record.checkpoints:
            # Recovery points mean a side effect may have happened: keep them for the retry.
            await self._keep_for_recovery(status)
            return
        try:
            released = await self.mw.call_store(
                self.mw.store.release, self.store_key, self.record.owner_token
            )
        except StoreError as exc:
            logger.error("could not release idempotency key %r: %s", self.key, exc)
            released = True
        if released:
            await self._ended(OutcomeResult.RELEASED, status)
        else:
            logger.warning("lock for %r was taken over before it could be released", self.key)
            await self._lock_lost("lock_lost", "taken_over", status)

    async def _keep_for_recovery(self, status: int | None) -> None:
        """End the lease now, keeping the checkpoints, so a retry recovers at once."""
        try:
            await self._save_progress(replace(self.record, locked_until=self.mw._clock()))
        except LockLostError:
            await self._lock_lost("lock_lost", "taken_over", status)
            return
        except StoreError as exc:
            logger.error("could not end the lease of idempotency key %r: %s", self.key, exc)
        await self._ended(OutcomeResult.RELEASED, status)


class _ResponseCapture:
    """The ``send`` the app gets: passes every message on to the client, keeps a copy of the
    response (up to ``max_response_bytes`` of body), and settles the outcome before the last
    body chunk goes out.

    Once the app has started its response the outcome is decided, however the response ends:
    a client that hangs up mid-stream, a ``send`` that raises, an app that stops its body on
    ``http.disconnect`` or raises half-way, a cancelled request task. Then
    :meth:`settle_unfinished` stores what was decided without the body it could not capture
    whole, so a retry never runs the handler again nor sees a truncated body as whole.
    """

    __slots__ = (
        "_marks",
        "_request",
        "chunks",
        "ended",
        "raw_headers",
        "settled",
        "size",
        "status",
    )

    def __init__(self, request: GuardedRequest, marks: RequestMarks) -> None:
        self._request = request
        self._marks = marks
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] | None = []  # None once the body outgrew max_response_bytes
        self.size = 0
        self.ended = False  # the app sent its last body chunk
        self.settled = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        request = self._request
        if kind == "http.response.start":
            self.status = message["status"]
            self.raw_headers = list(message.get("headers", ()))
        elif kind == "http.response.body" and not self.ended:
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > request.policy.max_response_bytes:
                self.chunks = None
            elif self.chunks is not None:
                self.chunks.append(chunk)
            if not message.get("more_body", False):
                self.ended = True
                await request._settle(self._marks, self.status, self.raw_headers, self.chunks)
                self.settled = True
        await request.send(message)

    async def settle_unfinished(self) -> None:
        """Settle a request whose response did not run to its end (see the class docs)."""
        if not self.status:
            # The app raised or returned before it started a response: nothing was decided,
            # so the client may retry with the same key.
            await self._request._release(None)
            return
        body = self.chunks if self.ended else None
        await self._request._settle(self._marks, self.status, self.raw_headers, body)


class _ReplayingReceive:
    """A receive that hands the buffered body to the app once, then defers to the client
    (so the app still sees ``http.disconnect``)."""

    __slots__ = ("_body", "_receive")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        body = self._body
        if body is None:
            return await self._receive()
        self._body = None
        return {"type": "http.request", "body": body, "more_body": False}
