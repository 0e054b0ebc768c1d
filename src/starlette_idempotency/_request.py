"""One guarded request's journey until it owns its key, or is answered without running.

Validate the key, buffer and fingerprint the body (read first, and parsed once, for a key read
from it: ``key_from``), and acquire the key as ``InProgress``; then
the app runs under the key's :class:`~starlette_idempotency._lease.Lease`, which settles the
outcome. A
key already held answers with a replay, a 409 (or a wait for the first request) or a 422
without running the app.

Why one module: every step before the key is owned reads what the one pass over the headers
found, and each answer to a key already held follows from the same comparison of records.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace

from starlette.exceptions import HTTPException

from starlette_idempotency._endpoint import REQUEST_SCOPE_KEY, InvalidCommandMarks
from starlette_idempotency._fingerprint import ParsedJson, raw_body_form, request_fingerprint
from starlette_idempotency._keys import (
    InvalidKey,
    KeySource,
    parse_key,
    sent_once_message,
    storage_key,
)
from starlette_idempotency._lease import Lease, ReplayingReceive, Run
from starlette_idempotency._record import IdempotencyRecord, RecordStatus
from starlette_idempotency._responses import (
    ALREADY_PROCESSED_MESSAGE,
    IN_PROGRESS_MESSAGE,
    MISMATCH_MESSAGE,
    RESPONSE_UNREADABLE_MESSAGE,
    STORE_UNAVAILABLE_MESSAGE,
    FirstRequest,
    Problem,
    replay_for,
    retry_after_seconds,
    send_http_exception,
    send_replay,
    send_requires_recovery,
)
from starlette_idempotency._routing import GuardedRoute
from starlette_idempotency._services import RequestServices
from starlette_idempotency._types import Body, Receive, Scope, Send
from starlette_idempotency.errors import LockLostError, StoreError
from starlette_idempotency.observability import CheckResult, RequestEvents
from starlette_idempotency.stores.base import AcquireResult

logger = logging.getLogger(__name__)

# A Content-Length that is not one decimal number (RFC 9110 calls the request malformed).
_INVALID_LENGTH = -1


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What one pass over a guarded request's headers found, for every step that reads them."""

    #: The values of the header the key comes in (one, unless the client sent it twice).
    raw_keys: tuple[bytes, ...]
    #: ``None`` without a Content-Length; ``_INVALID_LENGTH`` for one that is not one number.
    content_length: int | None
    content_type: str
    #: Whether a Content-Encoding other than ``identity`` was sent.
    content_encoded: bool
    #: The route's ``fingerprint_headers``, as sent.
    chosen_headers: tuple[tuple[str, str], ...]


def read_head(
    headers: list[tuple[bytes, bytes]], key_header: bytes | None, wanted: frozenset[bytes]
) -> RequestHead:
    """The head of a request with ``headers``, whose key comes in ``key_header``."""
    raw_keys: list[bytes] = []
    content_length: int | None = None
    content_type = ""
    content_encoded = False
    chosen: list[tuple[str, str]] = []
    for name, value in headers:
        if name == key_header:
            raw_keys.append(value)
        elif name == b"content-length":
            # Digits only, and few enough to be a length (int() refuses 4,300 and more).
            length = int(value) if value.isdigit() and len(value) <= 18 else _INVALID_LENGTH
            if content_length not in (None, length):
                length = _INVALID_LENGTH  # two Content-Length headers that disagree
            content_length = length
        elif name == b"content-type" and not content_type:
            content_type = value.decode("latin-1")
        elif name == b"content-encoding":
            content_encoded |= value.strip().lower() != b"identity"
        if name in wanted:
            chosen.append((name.decode("latin-1"), value.decode("latin-1")))
    return RequestHead(
        tuple(raw_keys), content_length, content_type, content_encoded, tuple(chosen)
    )


class GuardedRequest:
    """One request to a guarded route, from its headers to the key's owner or an answer."""

    __slots__ = (
        "_events",
        "_head",
        "_key_name",
        "_key_template",
        "_policy",
        "_receive",
        "_route",
        "_scope",
        "_send",
        "_services",
    )

    def __init__(
        self,
        services: RequestServices,
        route: GuardedRoute,
        key_template: str,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self._services = services
        self._route = route
        #: The route's template in the storage key: the path template, after the host the
        #: request matched when ``Host`` routes tell hosts apart.
        self._key_template = key_template
        self._policy = route.policy
        self._scope = scope
        self._receive = receive
        self._send = send
        self._events = RequestEvents(services.observer, scope["method"], route.template)
        source = route.policy.key_source
        #: How error titles name the key: ``None`` for the middleware's header.
        self._key_name = None if source is None else source.label
        key_header = services.limits.header_bytes if source is None else source.header_bytes or None
        self._head = read_head(scope["headers"], key_header, route.policy.fingerprint_header_names)

    async def _reject(
        self,
        problem: Problem,
        detail: str,
        result: CheckResult,
        *,
        retry_after: int | None = None,
        note: str | None = None,
        location: str | None = None,
        first: FirstRequest | None = None,
    ) -> None:
        await self._events.decided(result, note)
        await self._services.errors.send(
            self._send,
            problem,
            detail,
            retry_after=retry_after,
            location=location,
            request_headers=self._scope["headers"],
            key_name=self._key_name,
            first=first,
        )

    def start(self) -> Awaitable[None]:
        """What answers the request: its run as the key's owner, or a refusal."""
        source = self._policy.key_source
        if source is not None and not source.header_bytes:  # the key is in the body
            return self._run_with_key_in_body(source)
        limits = self._services.limits
        header_name = limits.header_name if source is None else source.name
        raw_keys = self._head.raw_keys
        if not raw_keys:
            return self._without_key(f"{header_name} header is required", None)
        key = (
            parse_key(
                raw_keys[0],
                header_name=header_name,
                max_length=limits.max_key_length,
                key_format=self._policy.key_check,
            )
            if len(raw_keys) == 1
            else InvalidKey(sent_once_message(header_name))
        )
        if isinstance(key, InvalidKey):
            return self._refuse_key(key)
        self._events.key = key
        return self._acquire_and_run(key)

    async def _run_with_key_in_body(self, source: KeySource) -> None:
        """The request of a route whose key is read from the body (a JSON field, or a
        function of the request and its body), which is read first, under the same limits."""
        body = await self._read_body()
        if body is None:
            return
        try:
            found, parsed = await source.read(
                self._scope,
                body,
                max_length=self._services.limits.max_key_length,
                key_format=self._policy.key_check,
            )
        except HTTPException as exc:  # the app's own refusal (a bad signature, say)
            await self._send_refusal(exc, body, CheckResult.INVALID_KEY, "key_from")
            return
        if found is None:
            await self._without_key(source.missing_message(), body)
            return
        if isinstance(found, InvalidKey):
            await self._refuse_key(found)
            return
        self._events.key = found
        await self._acquire_and_run(found, body, parsed)

    async def _without_key(self, message: str, body: Body | None) -> None:
        """A request whose source yields no key: refused on a required route, else run
        unprotected (with the ``body`` already read, if it was)."""
        if self._policy.required:
            await self._reject(Problem.MISSING_KEY, message, CheckResult.MISSING_KEY)
            return
        await self._events.decided(CheckResult.MISSING_KEY)
        receive = self._receive if body is None else ReplayingReceive(body, self._receive).receive
        await self._services.app(self._scope, receive, self._send)

    async def _refuse_key(self, invalid: InvalidKey) -> None:
        """400: the body a key is read from is not JSON, or the key is not one."""
        if invalid.malformed:
            await self._reject(
                Problem.INVALID_REQUEST, invalid.message, CheckResult.INVALID_REQUEST
            )
        else:
            note = "key_format" if invalid.by_format else None
            await self._reject(
                Problem.INVALID_KEY, invalid.message, CheckResult.INVALID_KEY, note=note
            )

    async def _read_body(self) -> Body | None:
        """The whole request body, or ``None`` once an answer was sent (413) or the client left.

        Held once: a body sent in several messages is gathered in one growing ``bytearray``,
        which the fingerprint reads in place and the app gets back in chunks (see
        :class:`~starlette_idempotency._lease.ReplayingReceive`)."""
        limit = self._services.limits.max_body_bytes
        if self._head.content_length == _INVALID_LENGTH:
            await self._reject(
                Problem.INVALID_REQUEST,
                "Content-Length must be one decimal number",
                CheckResult.INVALID_REQUEST,
            )
            return None
        if self._head.content_length is not None and self._head.content_length > limit:
            await self._body_too_large()
            return None
        gathered: bytearray | None = None  # the chunks of a body sent in several messages
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return None
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._body_too_large()
                return None
            more = message.get("more_body", False)
            if gathered is None:
                if not more:
                    return chunk  # the whole body in one message, kept as it came
                gathered = bytearray(chunk)
            else:
                gathered += chunk
            if not more:
                return gathered

    async def _body_too_large(self) -> None:
        await self._reject(
            Problem.BODY_TOO_LARGE,
            f"Request body exceeds the {self._services.limits.max_body_bytes}-byte limit "
            "for idempotent requests",
            CheckResult.TOO_LARGE,
        )

    def _fingerprint(self, body: Body, parsed: ParsedJson | None) -> str | None:
        """The request's fingerprint; ``None`` when ``fingerprint="validated"`` finds the body
        is not a valid command. An encoded body (``Content-Encoding: gzip``, which a custom
        route class may decode) is no command the middleware can read: it takes the raw form."""
        scope, head = self._scope, self._head
        command = self._route.command
        if command is None or head.content_encoded:
            kind, canonical = raw_body_form(
                body,
                content_type=head.content_type,
                excluded=self._policy.excluded_field_names,
                parsed=parsed,
            )
        else:
            form = command.canonical(body, head.content_type)
            if form is None:
                return None
            kind, canonical = form
        return request_fingerprint(
            operation=self._route.operation or "",
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=head.chosen_headers,
            body_kind=kind,
            body=canonical,
        )

    async def _acquire_and_run(
        self, key: str, body: Body | None = None, parsed: ParsedJson | None = None
    ) -> None:
        """Read the body (unless the key came in it), fingerprint it, acquire the key and run
        the app as its owner; or answer the request as the key's state says."""
        if body is None:
            body = await self._read_body()
            if body is None:
                return
        services, policy = self._services, self._policy
        fingerprint = self._fingerprint(body, parsed)
        if fingerprint is None:
            await self._pass_invalid_command(body)
            return
        try:
            owner = services.key_scope.owner(self._scope)
            if not isinstance(owner, str):  # an async key_scope's
                owner = await owner
        except HTTPException as exc:  # the app's own refusal (a bad token, say): its answer
            await self._send_refusal(exc, body, CheckResult.SCOPE_REFUSED)
            return
        store_key = storage_key(owner, self._scope["method"], self._key_template, key)
        now = services.clock()
        pending = IdempotencyRecord(
            key=key,
            status=RecordStatus.IN_PROGRESS,
            request_fingerprint=fingerprint,
            owner_token=os.urandom(16).hex(),  # secrets.token_hex(16), three calls fewer
            created_at=now,
            expires_at=now + policy.lock_ttl_seconds,
            fingerprint_version=self._route.fingerprint_version,
        )
        try:
            acquired = await services.store.try_acquire(
                store_key, pending, policy.lock_ttl_seconds, recover=policy.recover
            )
        except StoreError as exc:
            await self._on_store_down(exc, body)
            return
        if (
            not acquired.acquired
            and acquired.lease_expired
            and self._recovers_across_versions(acquired)
        ):
            # A dead handler's record of the version before a deploy: this request is its
            # retry (on_fingerprint_change="replay" trusts the key), so recover it under the
            # fingerprint it was stored with; the store takes it over only if, on its clock,
            # the lease is still out and the record is still that one.
            assert acquired.record is not None
            pending = replace(
                pending,
                request_fingerprint=acquired.record.request_fingerprint,
                fingerprint_version=acquired.record.fingerprint_version,
            )
            try:
                acquired = await services.store.try_acquire(
                    store_key, pending, policy.lock_ttl_seconds, recover=True
                )
            except StoreError as exc:
                await self._on_store_down(exc, body)
                return
        if not acquired.acquired:
            if self._is_waitable(acquired, fingerprint):
                after_wait = await self._wait_for_first(store_key, pending)
                if after_wait is None:
                    return
                acquired = after_wait
            if not acquired.acquired:
                await self._answer_existing(store_key, acquired, fingerprint)
                return
        lease = Lease(
            store=services.store,
            clock=services.clock,
            events=self._events,
            route=self._route,
            store_key=store_key,
            record=pending
            if acquired.record is None
            else self._owned_record(pending, acquired.record),
            responses=services.responses,
        )
        run = Run(lease, policy, body, self._receive, self._send)
        try:
            await run(services.app, self._scope, self._events, services.renewals)
        except LockLostError:
            if run.status:  # the response had begun: nothing else can be sent
                raise
            await self._answer_after_takeover(store_key, fingerprint)

    async def _answer_after_takeover(self, store_key: str, fingerprint: str) -> None:
        """This attempt's lease lapsed and another took its key over, so its transaction
        refused to commit (``idempotency_transaction`` raised ``LockLostError``): answer it
        as the duplicate it now is, with the other attempt's outcome once there is one."""
        try:
            record = await self._services.store.get(store_key)
        except StoreError:
            record = None
        if record is None or record.status is RecordStatus.IN_PROGRESS:
            await self._reject_in_progress(record, note="lock_lost")
            return
        await self._answer_existing(
            store_key, AcquireResult(acquired=False, record=record), fingerprint
        )

    async def _send_refusal(
        self, exc: HTTPException, body: Body, result: CheckResult, note: str | None = None
    ) -> None:
        """Answer the ``HTTPException`` a hook of the app raised, as the app answers it."""
        status = str(exc.status_code)
        await self._events.decided(result, note=status if note is None else f"{note}:{status}")
        await send_http_exception(
            exc, self._scope, ReplayingReceive(body, self._receive).receive, self._send
        )

    def _owned_record(
        self, pending: IdempotencyRecord, taken_over: IdempotencyRecord
    ) -> IdempotencyRecord:
        """The record this request now owns, having taken over an expired one: ``pending``, or
        the record taken over with its recovery points (which the store kept under our token,
        with a lease of its own clock). Only this same request's: a store may hand over the
        record of another request that used the key before its retention ended, whose points
        and fingerprint are not this one's."""
        if taken_over.status is not RecordStatus.IN_PROGRESS:
            return pending
        self._events.processing_timeout("expired_lease_taken_over")
        if (
            not taken_over.checkpoints
            or taken_over.request_fingerprint != pending.request_fingerprint
            or taken_over.fingerprint_version != pending.fingerprint_version
        ):
            return pending
        return replace(
            taken_over,
            owner_token=pending.owner_token,
            locked_until=None,
            expires_at=self._services.clock() + self._policy.ttl_seconds,
        )

    def _same_request(self, record: IdempotencyRecord, fingerprint: str) -> tuple[bool, str | None]:
        """Whether ``record`` was made by this same request, and a note for the event."""
        if record.fingerprint_version != self._route.fingerprint_version:
            # Fingerprinted under another scheme or route version (a deploy in between):
            # comparing the two would be meaningless, so the policy decides.
            return self._policy.on_fingerprint_change == "replay", "fingerprint_version_changed"
        return record.request_fingerprint == fingerprint, None

    def _recovers_across_versions(self, held: AcquireResult) -> bool:
        """Whether ``held``, an acquire refused by a record whose lease ran out (on the
        store's clock), is one this request recovers as the same request although the store
        would not: an ``InProgress`` record with recovery points, fingerprinted under another
        fingerprint version (a deploy in between), on a route that recovers by its handler and
        trusts the key across versions (``on_fingerprint_change="replay"``). A record of this
        route's own version is never adopted: there the fingerprints decide (the store
        recovers the same request's; another request's is a 422)."""
        record = held.record
        return (
            record is not None
            and self._policy.recover
            and self._policy.on_fingerprint_change == "replay"
            and record.status is RecordStatus.IN_PROGRESS
            and bool(record.checkpoints)
            and record.fingerprint_version != self._route.fingerprint_version
        )

    def _is_waitable(self, held: AcquireResult, fingerprint: str) -> bool:
        record = held.record
        assert record is not None
        return (
            self._policy.on_in_progress == "wait"
            and record.status is RecordStatus.IN_PROGRESS
            and not held.lease_expired  # the store's clock decides, never this pod's
            and self._same_request(record, fingerprint)[0]
        )

    async def _wait_for_first(
        self, store_key: str, pending: IdempotencyRecord
    ) -> AcquireResult | None:
        """Wait for the request holding the key to finish, then try again.

        Returns the final acquire result, or ``None`` once this request has been answered
        (409 when the wait timed out or too many requests already wait).
        """
        policy = self._policy
        deadline = time.monotonic() + policy.wait_timeout_seconds
        result: AcquireResult | None = None
        async with self._services.waiters.waiting(store_key) as watch:
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
                try:  # free: take it
                    result = await self._services.store.try_acquire(
                        store_key, pending, policy.lock_ttl_seconds, recover=policy.recover
                    )
                except StoreError:
                    continue  # the store hiccupped: keep waiting until the deadline
                if result.acquired or result.record is None:
                    return result
                if result.record.status is not RecordStatus.IN_PROGRESS:
                    return result
        await self._reject_in_progress(result.record if result else None, note="wait_timed_out")
        return None

    async def _pass_invalid_command(self, body: Body) -> None:
        """Let the app answer an invalid body with its own 422, without touching the store.

        Should the endpoint start anyway (the app accepted what its own model rejects), the
        start mark refuses to run it unprotected.
        """
        await self._events.decided(CheckResult.INVALID_BODY)
        scope = self._scope
        scope[REQUEST_SCOPE_KEY] = InvalidCommandMarks()
        await self._services.app(scope, ReplayingReceive(body, self._receive).receive, self._send)

    async def _on_store_down(self, exc: StoreError, body: Body) -> None:
        if self._policy.on_store_error == "fail_open":
            logger.warning(
                "idempotency store unavailable, running %s unprotected (fail_open): %s",
                self._events.endpoint,
                self._events.shown_error(exc),
            )
            await self._events.decided(CheckResult.FAIL_OPEN)
            await self._services.app(
                self._scope, ReplayingReceive(body, self._receive).receive, self._send
            )
            return
        logger.error(
            "idempotency store unavailable, answering 503: %s", self._events.shown_error(exc)
        )
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
            retry_after=retry_after_seconds(record, self._services.clock()),
            note=note,
        )

    def _first_request(self, store_key: str, record: IdempotencyRecord) -> FirstRequest | None:
        """What a 422 tells of the request that first used the key: its status, and its
        ``Location`` unless a sealed copy cannot be opened; ``None`` while it runs."""
        stored = record.response
        if stored is None:
            return None
        response = self._services.responses.read(stored, store_key)
        location = None if response is None else response.header("location")
        return FirstRequest(stored.status_code, location)

    async def _answer_existing(self, store_key: str, held: AcquireResult, fingerprint: str) -> None:
        record = held.record
        assert record is not None
        same_request, note = self._same_request(record, fingerprint)
        if not same_request:
            await self._reject(
                Problem.MISMATCH,
                MISMATCH_MESSAGE,
                CheckResult.MISMATCH,
                note=note,
                first=self._first_request(store_key, record),
            )
        elif held.lease_expired:  # on the store's clock
            # on_recovery="hold": a handler checkpointed and died; nobody may run it again
            # until an operator or a reconciler resolves the record.
            await self._events.decided(CheckResult.REQUIRES_RECOVERY, note=note)
            await send_requires_recovery(self._send, record.checkpoints[-1].name)
        elif record.status is RecordStatus.IN_PROGRESS or record.response is None:
            await self._reject_in_progress(record, note)
        elif (response := self._services.responses.read(record.response, store_key)) is None:
            # A sealed copy no configured key opens: the handler ran, so it must not run again,
            # and nothing unverified is sent.
            logger.error(
                "the stored response of a request to %s cannot be decrypted (its key id is not "
                "among ResponseEncryption's keys, or the record was altered): answering 503",
                self._events.endpoint,
            )
            await self._reject(
                Problem.RESPONSE_UNREADABLE,
                RESPONSE_UNREADABLE_MESSAGE,
                CheckResult.STORE_ERROR,
                note="response_unreadable",
            )
        elif self._policy.replay == "reject":
            await self._reject(
                Problem.ALREADY_PROCESSED,
                ALREADY_PROCESSED_MESSAGE,
                CheckResult.REPLAYED,
                note="replay_rejected",
                location=response.header("location"),
            )
        else:
            await self._events.decided(CheckResult.REPLAYED, note=note)
            await send_replay(
                self._send,
                replay_for(response, self._scope["headers"]),
                self._services.responses.replay_header,
            )
