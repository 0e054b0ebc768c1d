"""A key this request owns: the lease on its record, and the app's run under it.

A :class:`Lease` exists only once the store said the key is this request's, so its record is
always there. It holds the record and makes every write on it, each fenced by the record's
owner token: recovery points, renewals, the outcome, the release. A write that finds the key
taken over or gone is reported as ``LOCK_LOST``. It is also what the endpoint side sees of the
request (:class:`~starlette_idempotency._endpoint.IdempotencyContext`, and the marks the
decorator's wrapper and ``mark_retryable`` set), so nothing else is made per request for them.

A :class:`Run` runs the app as the key's owner: its own method is the app's ``send`` (every
message passed on, a copy of the response kept), as Starlette's ``GZipResponder`` does, and the
app's ``receive`` hands it the body the middleware already read (:class:`ReplayingReceive`).
It holds the last body chunk until the app returns, then settles the outcome on the lease and
sends it (see :meth:`Run.send`); and the start of a response of a declared length (a
``Content-Length``, or a 204 or 304, which has no body) until its first body chunk, so that a
response of one chunk reaches the server whole once it is stored: its two writes go out back to
back and wake the client once. Sent before the store's reply, the headers alone woke a client
that had gone back to sleep by the time the body came, a second wake-up per new key
(docs/explanation/benchmarks.md#start-held). A stream's start (no length: server-sent events, a
long poll) goes out as the app sends it, so its client is not kept from its headers while it
waits for the first chunk. Data flows one way: the run holds the lease and the lock's renewal,
neither holds the run, and the lease holds nothing of the request's scope, so a request leaves
no reference cycle behind.

Once the app has started its response the outcome is decided, however the response ends: a
client that hangs up mid-stream, a ``send`` that raises, an app that stops its body on
``http.disconnect`` or raises half-way, a cancelled request task. Then the run stores what was
decided without the body it could not capture whole, so a retry never runs the handler again
nor sees a truncated body as whole.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import time
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any

import anyio

from starlette_idempotency._endpoint import GUARDED_SCOPE, REQUEST_SCOPE_KEY, KeyOwner
from starlette_idempotency._kept_response import ResponseKeeper
from starlette_idempotency._options import IdempotencyPolicy
from starlette_idempotency._record import Checkpoint, IdempotencyRecord, RecordStatus
from starlette_idempotency._renewal import HeldLock, LockRenewal, LockRenewals, report_blocked
from starlette_idempotency._routing import GuardedRoute
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency._timers import LoopTimer
from starlette_idempotency._types import ASGIApp, Body, Clock, Message, Receive, Scope, Send
from starlette_idempotency.errors import (
    ConfigurationError,
    IdempotencyError,
    LockLostError,
    StoreError,
)
from starlette_idempotency.observability import CheckResult, OutcomeResult, RequestEvents
from starlette_idempotency.stores.base import FencedWrite, IdempotencyStore

logger = logging.getLogger(__name__)

# Without the decorator's start mark, these are what a step before the endpoint produces
# (request validation, authentication), so they release the key instead of being stored.
_PRE_ENDPOINT_STATUSES = frozenset({401, 403, 422})
# What the check for an app running on past its last chunk runs in: its own context is the
# request's, handed over as an argument (see Run.send).
_NO_CONTEXT = contextvars.Context()
# Response extensions whose body bypasses http.response.body and so could not be stored.
_UNCAPTURABLE_EXTENSIONS = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


async def _to_its_end(
    work: Coroutine[Any, Any, None], lease: Lease, failure: BaseException | None
) -> None:
    """Await ``work``, the ending of a request that ended with ``failure``, in a task of its
    own: a cancel, whether it ended the request or comes now, waits for ``lease``'s outcome to
    be written (or its key freed), then cuts what is left (sending to the client, the outcome's
    hooks), so that a cancelled request still ends soon and a retry finds its outcome. A cancel
    that comes now is raised once ``work`` is done, so ``asyncio.timeout()`` still sees its
    own. Made only for a request that did not end as it should."""
    task = asyncio.get_running_loop().create_task(work)
    ended_by_cancel = isinstance(failure, asyncio.CancelledError)
    if ended_by_cancel:
        lease.cut_after_write(task)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))  # which leaves the task running when it is cancelled
        except asyncio.CancelledError as exc:
            cancelled = exc
            lease.cut_after_write(task)
    if not ended_by_cancel and cancelled is None:
        task.result()
        return
    # The cancel goes on (with the app's own error as its context, if it raised): raised, the
    # ending's own failure would hide the one or the other.
    _report_failure(task)
    if cancelled is not None:
        raise cancelled


def _shown_status(status: int | None) -> str:
    return "no response" if status is None else f"status {status}"


def _report_failure(ending: asyncio.Task[None]) -> None:
    """Log what a cancelled request's ending raised, if anything, once it is done."""
    if not ending.cancelled() and (error := ending.exception()) is not None:
        logger.error("the ending of a cancelled request failed", exc_info=error)


def _going_on_from(record: IdempotencyRecord, taken: IdempotencyRecord | None) -> IdempotencyRecord:
    """``record`` with the recovery points of ``taken``, the record its take-back took over,
    when a successor went on from ``record``'s (it recovered the key, saved more, and let it
    go): they say what that successor's effects were, for whichever retry comes next. Points
    are told apart by name: read back from a store, their times are to the millisecond."""
    own = [point.name for point in record.checkpoints]
    if (
        taken is None
        or taken.status is not RecordStatus.IN_PROGRESS
        or taken.request_fingerprint != record.request_fingerprint
        or taken.fingerprint_version != record.fingerprint_version
        or [point.name for point in taken.checkpoints[: len(own)]] != own
    ):
        return record
    return replace(record, checkpoints=taken.checkpoints)


class Lease(KeyOwner):
    """A key this request owns, from the acquire until its outcome is settled."""

    __slots__ = (
        "_clock",
        "_cut",
        "_events",
        "_responses",
        "_route",
        "_store",
        "decided",
        "endpoint_started",
        "freed",
        "in_doubt",
        "in_the_apps_transaction",
        "inherited",
        "key",
        "must_not_start",
        "record",
        "recorded",
        "retryable",
        "started",
        "store_key",
        "taken_over",
        "transaction_open",
        "written",
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
        self.store_key = store_key
        #: The record as this request last wrote it (its checkpoints and owner token; its
        #: lease is the store's to keep).
        self.record = record
        self.key = record.key
        self.inherited = record.checkpoints
        #: Set once the response has ended, or the key is freed: no recovery point after it
        #: (one from a background task would come between the response and its storing).
        self.decided = False
        #: Set once the key is freed for a retry (or its lease ended, for a recovery).
        self.freed = False
        # What the endpoint side reports (see _endpoint.Marks).
        self.endpoint_started = False
        self.retryable = False
        self.must_not_start = False
        #: Set once the response starts: a retryable mark after it changes nothing.
        self.started = False
        #: An idempotency_transaction holds the record's row (see _transaction).
        self.transaction_open = False
        #: The outcome an idempotency_transaction committed: its status and body.
        self.recorded: tuple[int, bytes] | None = None
        #: ``recorded`` was written in a transaction of the app's, which commits it (or, on a
        #: serialization failure, say, rolls it back and runs again: see _transaction).
        self.in_the_apps_transaction = False
        #: Set when an idempotency_transaction's commit may or may not have happened: nothing
        #: more is written for the request, and its lock lapses (see _transaction).
        self.in_doubt = False
        #: Set once the outcome is written or the key freed, before its event: a settle that a
        #: cancel cut short after its write is not written or reported twice when run again.
        self.written = False
        #: Set while another request holds the key this one's lock lost (reported once).
        self.taken_over = False
        # The ending of a cancelled request, to cancel once the outcome is written.
        self._cut: asyncio.Task[None] | None = None

    def _wrote(self) -> None:
        """The outcome is written or the key freed: a cancelled request's ending may stop."""
        self.written = True
        if (cut := self._cut) is not None:
            self._cut = None
            cut.cancel()

    def cut_after_write(self, ending: asyncio.Task[None]) -> None:
        """Cancel ``ending``, a cancelled request's, once the outcome is written or the key
        freed: what comes after (sending to the client, the outcome's hooks) is the request's,
        and it was cancelled; the write is what a retry depends on."""
        if self.written:
            ending.cancel()
        else:
            self._cut = ending

    @property
    def request_fingerprint(self) -> str:
        return self.record.request_fingerprint

    @property
    def policy(self) -> IdempotencyPolicy:
        return self._route.policy

    @property
    def store(self) -> IdempotencyStore:
        """The store the record is in (unbounded: the app's transaction has its own limits)."""
        return self._store.store

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """Save a recovery point on the record (see ``checkpoint``)."""
        if self.transaction_open:
            raise IdempotencyError(
                f"checkpoint({name!r}) inside idempotency_transaction: call tx.checkpoint(), "
                "which writes it in the transaction that holds the record"
            )
        record = self.with_checkpoint(self.record, name, data)
        await self._save_progress(record, self._route.policy.lock_ttl_seconds)

    def with_checkpoint(self, record: IdempotencyRecord, name: str, data: Any) -> IdempotencyRecord:
        """``record`` with one more recovery point, to be saved while the handler runs."""
        if not self._store.store.supports_recovery:
            raise ConfigurationError(
                f"{type(self._store.store).__name__} cannot keep recovery points: use "
                "RedisStore, PostgresStore or MemoryStore"
            )
        if self.decided:
            raise IdempotencyError(
                f"checkpoint({name!r}) came after the outcome of idempotency key "
                f"{self._events.shown_key!r} was decided (its response stored, or its key "
                "freed): a recovery point can only be saved while the handler runs, before its "
                "response ends (not from a background task, which runs after it)"
            )
        now = self._clock()
        return replace(
            record,
            checkpoints=(*record.checkpoints, Checkpoint(name, data, now)),
            expires_at=now + self._route.policy.ttl_seconds,
        )

    async def _save_progress(self, record: IdempotencyRecord, lease: float) -> None:
        saved = await self._store.save_progress(
            self.store_key, record, self._route.policy.ttl_seconds, lease
        )
        if not saved:
            raise LockLostError(
                f"the lock for idempotency key {self._events.shown_key!r} was taken over"
            )
        self.record = record

    async def renew(self) -> bool:
        """Extend the lock (for a record with recovery points, its lease), taking the key back
        if it vanished or another request let it go; false once there is nothing left to renew
        (another request stored the key's outcome, or this one's is committed or in doubt)."""
        if self.transaction_open:  # its row is locked: nobody can take the key over
            return True
        if self.in_doubt:  # to lapse
            return False
        if self.recorded is not None and not self.in_the_apps_transaction:
            return False  # the transaction finished the record
        policy = self._route.policy
        renewed = await self._store.renew(
            self.store_key, self.record, policy.lock_ttl_seconds, policy.ttl_seconds
        )
        if self.recorded is not None:
            # The app's transaction, which writes the outcome, has ended (a renewal waits for
            # the row while it is open): committed, the record is finished and there is
            # nothing to renew or take back; rolled back, its retry runs the block again.
            return renewed
        return renewed or await self._reclaim()

    async def keep_recovered(self) -> None:
        """Renew at once the lease of a record this request recovered, so that the store keeps
        it for the route's retention from now on: the takeover kept it only until its lease's
        end, and the retention counted from the dead attempt's recovery point may be all but
        over. Should this handler die too before its first renewal, a retry still recovers it
        rather than run afresh without its recovery points. A failure is logged: the renewals,
        if any, try again."""
        try:
            await self.renew()
        except StoreError as exc:
            logger.warning(
                "could not renew the lock for %r after recovering it: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )

    async def _reclaim(self) -> bool:
        """Take back the key with this request's own owner token if nobody holds it; whether
        to try again at the next renewal.

        The lock can vanish while its handler runs: evicted under ``maxmemory``, deleted by an
        operator, expired while the process was frozen. Until it is back, a retry could run
        the handler a second time, so it is taken back at once and reported as ``LOCK_LOST``.
        Another request holding it may let it go before this handler ends (an acquire whose
        request gave up, undone; a release; a lapse): until that request's outcome is stored,
        each renewal tries again.
        """
        policy = self._route.policy
        lock_ttl = policy.lock_ttl_seconds
        now = self._clock()
        # Held by the acquire's lock TTL, with no lease of its own until it is saved again.
        record = replace(self.record, locked_until=None, expires_at=now + lock_ttl)
        # Never undone if cut short, as an abandoned acquire is: this handler still runs.
        result = await self._store.take_back(self.store_key, record, lock_ttl)
        if not result.acquired:
            if not self.taken_over:
                self.taken_over = True
                logger.warning(
                    "the lock for idempotency key %r was taken over by another request while "
                    "its handler ran; its response will not be stored unless that request "
                    "lets the key go first",
                    self._events.shown_key,
                )
                await self._events.lock_lost("lock_lost", "taken_over")
            holder = result.record
            return holder is None or holder.status is RecordStatus.IN_PROGRESS
        self.taken_over = False
        record = _going_on_from(record, result.record)
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
        self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes | None
    ) -> None:
        """Store the response as the key's outcome (``body`` is ``None`` when it was not
        captured whole), or release the key: a status ``release_statuses`` frees (by default
        5xx, 408, 429), a retryable mark, a status from before the endpoint."""
        self.decided = True
        if self.written or self.recorded is not None or self.in_doubt:
            await self._nothing_to_write(status, body)
            return
        outcome = self.outcome(status, raw_headers, body)
        if outcome is None:
            await self.release(status)
            return
        record, note = outcome
        ttl = self._route.policy.ttl_seconds
        try:
            stored = await self._store.finish_for[record.status](self.store_key, record, ttl)
        except StoreError as exc:
            logger.error(
                "could not store the response for idempotency key %r; a retry is answered 409 "
                "until the lock expires and then runs again: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
            stored = FencedWrite.WRITTEN  # not lost to another owner: still this request's
        self._wrote()
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
            OutcomeResult.COMPLETED if status < 400 else OutcomeResult.FAILED, status, note
        )

    async def _nothing_to_write(self, status: int | None, body: bytes | None) -> None:
        """The end of a request that writes nothing more: its outcome is written, committed
        with the app's writes (never undone here), or in doubt."""
        if self.written:
            return
        if self.recorded is not None:
            await self._sent_recorded(status, body)
        elif self.in_doubt:
            await self._leave_in_doubt(
                status,
                f"the idempotency_transaction of idempotency key {self._events.shown_key!r} "
                "ended without knowing whether it committed",
            )

    def outcome(
        self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes | None
    ) -> tuple[IdempotencyRecord, str | None] | None:
        """The finished record of a response kept as the key's outcome, and the redactor's
        note; ``None`` when a response of ``status`` frees the key for a retry instead: a status
        ``release_statuses`` frees (by default 5xx, 408, 429), a retryable mark, an answer from
        before the endpoint (any of a decorated route whose endpoint did not start: its
        dependencies', its validation's, a login redirect's), but a success under a decorator
        above the endpoint, which may have run it where it could not report its start."""
        route = self._route
        policy = route.policy
        if self.retryable or policy.releases(status):
            return None
        if not route.marks_start:
            if status in _PRE_ENDPOINT_STATUSES:
                return None
        elif not self.endpoint_started:
            if not (route.decorated_above and 200 <= status < 300):
                return None
            # No dependency or validation answers a success: the endpoint ran where it could
            # not tell (freed, its answer would let every retry run it again).
            logger.warning(
                "%s answered %s for idempotency key %r without its @idempotent endpoint "
                "reporting that it started: kept as the key's outcome. The endpoint runs outside "
                "the request's context (a decorator above @idempotent that runs it in an "
                "executor or a task without copying contextvars: use anyio.to_thread.run_sync "
                "or contextvars.copy_context().run), or a middleware inside "
                "IdempotencyMiddleware answered for it",
                self._events.endpoint,
                status,
                self._events.shown_key,
            )
        kept, note = self._responses.keep(
            policy.stored_parts, self.store_key, status, raw_headers, body
        )
        record = self.record.finished(
            RecordStatus.COMPLETED if status < 400 else RecordStatus.FAILED,
            kept,
            expires_at=self._clock() + policy.ttl_seconds,
        )
        return record, note

    async def _sent_recorded(self, status: int | None, body: bytes | None) -> None:
        """The response going out after an idempotency_transaction committed the outcome: it
        is not written again; one that differs from the committed one is an error of the
        app's (retries are answered with the committed one). When the block joined a
        transaction of the app's, whose commit is not seen here, another status (an exception,
        a 500) says that commit may have failed: the outcome is then in doubt."""
        assert self.recorded is not None
        recorded_status, recorded_body = self.recorded
        if status != recorded_status and self.in_the_apps_transaction:
            await self._leave_in_doubt(
                status,
                f"the request of idempotency key {self._events.shown_key!r} was answered with "
                f"{_shown_status(status)}, not the status {recorded_status} its "
                "idempotency_transaction recorded in the app's transaction: that transaction "
                "may not have committed",
            )
            return
        self._wrote()
        if status != recorded_status or (body is not None and body != recorded_body):
            logger.error(
                "the response to idempotency key %r (%s) differs from the one its "
                "idempotency_transaction committed (%s); retries are answered with the "
                "committed one. Return the response tx.respond() returned, unchanged",
                self._events.shown_key,
                _shown_status(status),
                f"status {recorded_status}",
            )
        await self._events.ended(
            OutcomeResult.COMPLETED if recorded_status < 400 else OutcomeResult.FAILED, status
        )

    async def _leave_in_doubt(self, status: int | None, why: str) -> None:
        """Write nothing for a request whose idempotency_transaction may have committed: a
        release would delete the record it committed, a finish would overwrite it. Its lock
        lapses, as a crashed pod's does, and a retry then finds what committed."""
        self._wrote()
        logger.error(
            "%s; the key is left locked until its lock expires (lock_ttl_seconds), and a retry "
            "then gets the committed response, or runs again if nothing committed",
            why,
        )
        await self._events.ended(OutcomeResult.LOCK_LOST, status, "in_doubt")

    async def release(self, status: int | None) -> None:
        """Free the key for a retry (keeping its recovery points, if it has any)."""
        self.decided = True
        if self.written or self.recorded is not None or self.in_doubt:
            await self._nothing_to_write(status, None)
            return
        self.freed = True
        if self.record.checkpoints:
            # Recovery points mean a side effect may have happened: keep them for the retry.
            await self._keep_for_recovery(status)
            return
        try:
            released = await self._store.release(self.store_key, self.record.owner_token)
        except StoreError as exc:
            logger.error(
                "could not release idempotency key %r: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
            released = True
        self._wrote()
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
            self._wrote()
            await self._events.lock_lost("lock_lost", "taken_over", status)
            return
        except StoreError as exc:
            logger.error(
                "could not end the lease of idempotency key %r: %s",
                self._events.shown_key,
                self._events.shown_error(exc),
            )
        self._wrote()
        await self._events.ended(OutcomeResult.RELEASED, status)


#: The size of the messages a body gathered from several is handed to the app in (what uvicorn
#: reads at a time): the app's parser streams them, and nothing holds a second copy.
REPLAY_CHUNK_BYTES = 64 * 1024


class _BodyReplay:
    """Its :meth:`receive` hands the buffered body (``_body``) to the app, then defers to the
    client's ``_receive`` (so the app still sees ``http.disconnect``): a body that came in one
    message as that message, one gathered from several in messages of
    :data:`REPLAY_CHUNK_BYTES`. The classes it serves set both fields in their own
    ``__init__``."""

    __slots__ = ("_body", "_receive")

    _body: Body | memoryview | None
    _receive: Receive

    async def receive(self) -> Message:
        body = self._body
        if body is None:
            return await self._receive()
        if type(body) is bytes:
            self._body = None
            return {"type": "http.request", "body": body, "more_body": False}
        view = memoryview(body)  # slices of it copy nothing
        rest = view[REPLAY_CHUNK_BYTES:]
        self._body = rest if rest else None
        chunk = view[:REPLAY_CHUNK_BYTES].tobytes()
        return {"type": "http.request", "body": chunk, "more_body": bool(rest)}


class ReplayingReceive(_BodyReplay):
    """The app's ``receive`` for a request whose body the middleware read, not run as the
    key's owner (fail-open, a body the route's model rejects, a hook's refusal)."""

    __slots__ = ()

    def __init__(self, body: Body, receive: Receive) -> None:
        self._body = body
        self._receive = receive


class Run(_BodyReplay):
    """The app running as the owner of ``lease``: :meth:`receive` (the body the middleware
    read, then the client's) and :meth:`send` are what the app is given, and the outcome is
    settled before the response's last chunk goes out."""

    __slots__ = (
        "_client_send",
        "_context",
        "_events",
        "_final",
        "_if_running",
        "_lag_reported",
        "_lease",
        "_policy",
        "_renewal",
        "_renewals",
        "_sending",
        "_start",
        "_started",
        "_timer",
        "chunks",
        "declared_length",
        "due",
        "ended",
        "fired",
        "kept_body",
        "raw_headers",
        "settled",
        "size",
        "status",
    )

    def __init__(
        self, lease: Lease, policy: IdempotencyPolicy, body: Body, receive: Receive, send: Send
    ) -> None:
        self._body = body
        self._receive = receive
        self._lease = lease
        self._policy = policy
        self._client_send = send
        self._timer: LoopTimer | None = None  # while waiting for the lock's first third
        self._renewal: LockRenewal | None = None  # once the handler outlived it
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] | None = []  # None once the body outgrew max_response_bytes
        self.size = 0
        self.ended = False  # the app sent its last body chunk
        self.kept_body: bytes | None = None  # then, the body kept (None: not whole)
        self.settled = False
        #: The Content-Length the response declared (0 for a 204 or a 304); None: a stream.
        self.declared_length: int | None = None
        self._start: Message | None = None  # the response's start, held until its first chunk
        self._final: Message | None = None  # that chunk, held until the outcome is settled
        self._sending: asyncio.Task[None] | None = None  # settling and sending it, apart

    async def __call__(
        self, app: ASGIApp, scope: Scope, events: RequestEvents, renewals: LockRenewals
    ) -> None:
        """Run the app and settle the outcome, however it ends."""
        lease = self._lease
        extensions = scope.get("extensions")
        if extensions and not _UNCAPTURABLE_EXTENSIONS.isdisjoint(extensions):
            kept = {k: v for k, v in extensions.items() if k not in _UNCAPTURABLE_EXTENSIONS}
            scope = {**scope, "extensions": kept}
            GUARDED_SCOPE.set(scope)  # the guard's own resets it
        scope[REQUEST_SCOPE_KEY] = lease
        self._events = events
        if self._policy.renew_lock:
            self._await_renewal(renewals)
        try:
            if lease.inherited:  # recovered: kept for its retention from now
                await lease.keep_recovered()
            # In here, so that a cancel while a hook takes the event frees the key.
            await events.decided(
                CheckResult.ACQUIRED, note="recovering" if lease.inherited else None
            )
            await app(scope, self.receive, self.send)
            if self._timer is not None:  # a renewal now would find the record final
                self._stop_renewal()
            if self._final is not None:  # the app returned at once: settle, then send (see send)
                if self.declared_length is not None:  # see send
                    self._if_running.cancel()  # which lets go of this run now, not next turn
                await lease.settle(self.status, self.raw_headers, self.kept_body)
                self.settled = True
                if (start := self._start) is not None:  # _send_start, inline
                    self._start = None
                    await self._client_send(start)
                # Held until now: a cancel during the settle leaves it to the ending's send.
                final, self._final = self._final, None
                await self._client_send(final)
            else:
                await self._release_final()
        finally:
            if self._timer is not None:
                self._stop_renewal()
            if not self.settled or self._sending is not None:
                # Shielded from anyio's scopes by the scope, from a task.cancel() (which anyio's
                # shield lets through: asyncio.timeout(), a server's) by a task of its own, so
                # that a cancelled request still settles or frees its key.
                with anyio.CancelScope(shield=True):
                    failure = sys.exc_info()[1]
                    try:
                        await _to_its_end(self._end_abnormally(failure), lease, failure)
                    finally:
                        self._let_go_of_sending()

    async def send(self, message: Message) -> None:
        """Pass ``message`` on to the client, keeping a copy of the response (up to
        ``max_response_bytes`` of body); the last body chunk goes out once it is settled, and
        the start of a response of a declared length with its first chunk."""
        kind = message["type"]
        if self.ended:  # something after the last chunk (trailers): that goes out first
            await self._release_final()
        elif kind == "http.response.start":
            self._lease.started = True
            # An IntEnum (HTTPStatus) as the app gave it would reach the store as one.
            self.status = status = int(message["status"])
            self.raw_headers = headers = list(message.get("headers", ()))
            # A response of a declared length (or of none: 204, 304) is held until its first
            # chunk, so that one of one chunk reaches the client in two writes back to back,
            # which wake it once (see the module docs); a stream's headers go out at once.
            if status == 204 or status == 304:
                self._start = message
                self.declared_length = 0
                return
            for name, value in headers:
                if name == b"content-length":
                    self._start = message
                    if value.isdigit():
                        self.declared_length = int(value)
                    return
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > self._policy.max_response_bytes:
                self.chunks = None
            elif self.chunks is not None:
                self.chunks.append(chunk)
            if not message.get("more_body", False):
                self.ended = True
                self._lease.decided = True
                chunks = self.chunks
                self.kept_body = None if chunks is None else b"".join(chunks)
                self.chunks = None  # held once, in kept_body
                declared = self.declared_length
                if declared is not None and declared != self.size:  # broken off, or too long
                    self.kept_body = None
                # Held until the app returns, and settled then, with the app's frames gone:
                # across the store's reply the request holds only what is ours (a Starlette
                # response returns at once unless it has background tasks). An app that runs
                # on past this turn of the loop has a response of a declared length settled
                # and sent meanwhile, apart. A stream waits for its app, renewing its lock:
                # one the app broke off may end before the app raises (Starlette's
                # BaseHTTPMiddleware ends it so), and must not be kept as whole.
                self._final = message
                if declared is not None:
                    # The request's context goes in the arguments, which a cancel lets go of
                    # at once.
                    self._if_running = asyncio.get_running_loop().call_soon(
                        self._if_still_running, contextvars.copy_context(), context=_NO_CONTEXT
                    )
                return
        await self._send_start()
        await self._client_send(message)

    def _if_still_running(self, context: contextvars.Context) -> None:
        final, self._final = self._final, None
        if final is not None:  # its background tasks run: the client does not wait for them
            if self._timer is not None:
                self._stop_renewal()
            self._sending = asyncio.get_running_loop().create_task(
                self._settle_and_send(final), context=context
            )

    async def _release_final(self) -> None:
        """Settle and send the held last chunk, or wait for the task doing it: a cancel of this
        request cuts that task short only once it has settled (else the request's ending waits
        for it again)."""
        final, self._final = self._final, None
        if final is not None:
            await self._settle_and_send(final)
        elif (sending := self._sending) is not None:
            try:
                await asyncio.shield(sending)
            finally:
                if sending.done():
                    self._sending = None

    def _let_go_of_sending(self) -> None:
        """After the ending: a task still settling and sending apart was cut with it, its
        outcome written (see _to_its_end); what it is left to send is a cancelled request's."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.cancel()
            sending.add_done_callback(_report_failure)

    async def _settle_and_send(self, final: Message) -> None:
        # What Run.__call__ does itself when the app returned at once: inline there, so that
        # no frame of ours besides its own waits on the store's reply on the common path (and
        # a new key's calls stay within their budget: tests/core/test_call_budget.py).
        await self._lease.settle(self.status, self.raw_headers, self.kept_body)
        self.settled = True
        await self._send_start()
        await self._client_send(final)

    async def _send_start(self) -> None:
        """Send the response's start if it is still held."""
        if (start := self._start) is not None:
            self._start = None
            await self._client_send(start)

    # Waiting in the loop's renewal timer (see _renewal): the run is the timer's entry, so a
    # handler shorter than a third of its lock's TTL makes nothing for its renewal.

    def _await_renewal(self, renewals: LockRenewals) -> None:
        """Wait in the loop's renewal timer for the lock's first third."""
        loop = asyncio.get_running_loop()
        timer = renewals.timers.last
        if timer is None or timer.loop is not loop:
            timer = renewals.timers.get(loop)
        interval = self._policy.lock_ttl_seconds / 3
        if interval / 10 < timer.resolution:  # a short lock TTL needs a finer check
            timer.resolution = interval / 10
        self._renewals = renewals
        self._timer = timer
        # The renewal starts from the timer's callback: give it this request's context
        # (tracing spans, log correlation), not the one that armed the timer.
        self._context = contextvars.copy_context()
        self._started = loop.time()
        self.due = self._started + interval
        self.fired = False
        self._lag_reported = False
        timer.entries.add(self)
        if timer.handle is None:
            timer.arm()

    def _held_lock(self) -> HeldLock:
        policy = self._policy
        return HeldLock(
            policy.lock_ttl_seconds, self._events.endpoint, policy.max_processing_seconds
        )

    def fire(self) -> None:
        """The handler outlived its lock's first third: renew it from now on."""
        self._renewal = LockRenewal(
            self._lease.renew,
            self._events,
            self._held_lock(),
            self._renewals.observer,
            started=self._started,
            context=self._context,
        )

    def blocked(self, gap: float) -> None:
        """The loop ran nothing for ``gap`` seconds (its timer saw it late): reported once,
        when that is half the lock's TTL or more."""
        if self._lag_reported or gap < self._policy.lock_ttl_seconds / 2:
            return
        self._lag_reported = True
        report_blocked(self._held_lock(), self._events, self._renewals.observer, gap)

    def _stop_renewal(self) -> None:
        timer = self._timer
        assert timer is not None
        self._timer = None
        timer.entries.discard(self)
        if self._renewal is not None:
            self._renewal.stop()
        # A handler that blocked the loop until it ended stops before the timer's next check.
        gap = time.monotonic() - timer.checked_at
        if gap >= self._policy.lock_ttl_seconds / 2:
            self.blocked(gap)

    async def _end_abnormally(self, failure: BaseException | None) -> None:
        """End a run that raised or was cancelled: a response the app had sent whole goes out
        as it is, settled; any other is settled as unfinished. A stream ended before the app
        raised may be cut short: kept without its body, never as whole."""
        if (
            self._final is not None
            and self.declared_length is None
            and isinstance(failure, Exception)
        ):
            self.kept_body = None
        await self._release_final()
        if not self.settled:
            await self._settle_unfinished(failure)
        # A start the app sent without its last chunk still goes out, as the app sent it, so
        # that its client sees the response begun and cut short, not the server's own 500.
        await self._send_start()

    async def _settle_unfinished(self, failure: BaseException | None) -> None:
        """Settle a request whose response did not run to its end (see the module docs)."""
        if not self.status:
            # The app raised or returned before it started a response: the server answers 500,
            # stored (without the body this never sees) where release_statuses keeps a 500.
            # Cancelled, or a 500 that frees the key: the client may retry with the same key.
            if isinstance(failure, Exception | None) and not self._policy.releases(500):
                await self._lease.settle(500, [], None)
            else:
                await self._lease.release(None)
            return
        await self._lease.settle(self.status, self.raw_headers, self.kept_body)
