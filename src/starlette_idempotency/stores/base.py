"""The store protocol every backend implements.

A store knows nothing of HTTP: it keeps :class:`IdempotencyRecord` values under storage keys and
offers a few atomic primitives. Every write after the acquire is fenced by the owner token, so a
request whose lock expired and was taken over can neither overwrite nor delete its successor's
record.

Every lock, lease and expiry is decided on the store's own clock (a TTL counted by the server,
PostgreSQL's ``now()``, Redis's ``TIME``, a monotonic clock in process): the middleware passes
durations, never instants of its own pod's clock, so pods whose clocks disagree still agree on
who holds a key.
"""

from __future__ import annotations

import enum
import inspect
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Literal, Protocol, runtime_checkable

from starlette_idempotency._deprecation import deprecated
from starlette_idempotency._record import IdempotencyRecord, RecordStatus, StoredResponse

DEFAULT_KEY_PREFIX = "idempotency"
DEFAULT_RESOLVED_TTL = 24 * 3600.0
#: The range of :meth:`StoreBase.resolve`'s ``ttl``: a shorter one lets the record go before
#: any retry comes (which then runs again); a longer one is no date the stores can keep.
RESOLVED_TTL_RANGE = (1.0, 100 * 365 * 24 * 3600.0)
#: How long :meth:`StoreBase.resolve` holds a record it took over before finishing it: a retry
#: in between gets 409.
_RESOLVER_LOCK_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """What :meth:`IdempotencyStore.try_acquire` found.

    ``acquired`` is true when the caller now owns the key. Then ``record`` is the expired record
    it took over, where the store can tell (else ``None``), with its recovery points only when
    it recovered them (the same request's record, its lease run out, its retention not): the
    points of a record whose retention ended stay behind, as the middleware reads them as the
    caller's own. When ``acquired`` is false,
    ``record`` is the live record that holds the key, and ``lease_expired`` says whether it is
    an ``InProgress`` record with recovery points whose lease has run out on the store's clock
    (its handler died; with ``recover=False`` nobody took it over). ``None`` is a store that
    does not say (one written for the protocol of 0.1): the middleware then judges the
    lease on its own clock, as it did.
    """

    acquired: bool
    record: IdempotencyRecord | None = None
    lease_expired: bool | None = None


class FencedWrite(enum.IntEnum):
    """What a write fenced by the owner token did; falsy only when nothing was written.

    ``RECLAIMED`` is the owner taking back a key that had vanished while it held it (evicted
    under ``maxmemory``, deleted by an operator, its lock expired while the process was
    frozen): the write went through, but for a while nobody held the key, so a retry could
    have run the handler again. The middleware reports it as ``LOCK_LOST``.
    """

    LOST = 0
    """Another owner holds the key: nothing was written."""
    WRITTEN = 1
    """The owner still held the key."""
    RECLAIMED = 2
    """The key was gone; the owner wrote it back."""


@dataclass(frozen=True, slots=True)
class StoreFinding:
    """One thing :meth:`CheckableStore.check` found: an ``error`` makes the store unusable,
    a ``warning`` weakens the guarantees (records that can be evicted or lost)."""

    level: Literal["error", "warning"]
    message: str


@runtime_checkable
class CheckableStore(Protocol):
    """A store that can check itself at startup (and for ``starlette-idempotency doctor``)."""

    def describe(self) -> str:
        """Where the store is, for messages: ``redis at 127.0.0.1:6379/0`` (no password)."""
        ...

    async def check(self) -> list[StoreFinding]:
        """Reach the store and report what weakens it; unreachable is one ``error`` finding
        (never an exception)."""
        ...


@runtime_checkable
class IdempotencyStore(Protocol):
    """Atomic primitives over idempotency records, shared by all processes using the store.

    ``key`` is the storage key built by the middleware (the store adds its own prefix). All
    durations are in seconds and may be fractional. Subclass :class:`StoreBase` to implement
    one: it adds what is built on these primitives (:meth:`StoreBase.resolve`).
    """

    #: A short name for logs and metrics labels ("memory", "redis", "postgres").
    name: str
    #: Whether the store keeps recovery points: takes over an ``InProgress`` record whose
    #: lease has run out on the store's clock, atomically, even though the record itself lives
    #: on.
    supports_recovery: bool

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        """Write ``pending`` (an ``InProgress`` record) if the key is free, in one atomic step.

        A free key is one that is absent or whose record has expired. With ``recover`` (and
        ``supports_recovery``), an ``InProgress`` record with checkpoints whose lease has run
        out and whose fingerprint and version equal ``pending``'s is taken over too: it keeps
        its checkpoints, gets ``pending``'s owner token and a lease of ``lock_ttl``, and is
        returned as the record taken over. Otherwise return the existing record untouched,
        with ``lease_expired`` set (see :class:`AcquireResult`). Whether a lease has run out is
        decided by the store, on its own clock, in the same atomic step as the takeover.
        """
        ...

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        """Store the final ``record`` (``Completed`` or ``Failed``) for ``ttl`` seconds if its
        owner still holds the key.

        Returns ``WRITTEN`` then. When the key is absent (evicted, deleted, or the lock lapsed
        and nobody took it over) it is stored too and the answer is ``RECLAIMED``. Returns
        ``LOST``, writing nothing, when another owner holds the key.
        """
        ...

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        """Replace the owner's ``InProgress`` record (new checkpoints) and keep it for ``ttl``,
        with a lease of ``lease`` seconds from now on the store's clock (``0`` ends it now, so
        that a retry recovers at once). The store sets the lease: ``record.locked_until`` is
        not read.

        Writes only while ``record.owner_token`` holds the key and the record there is still
        ``InProgress``; returns false, writing nothing, otherwise. So no late write (a
        checkpoint after the response, a command resent after a reconnect) ever turns a
        finished record back.
        """
        ...

    async def release(self, key: str, owner_token: str) -> bool:
        """Delete the key if ``owner_token`` still holds it.

        Returns false when another owner holds the key (nothing is deleted), true otherwise.
        """
        ...

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        """Extend the lock of an ``InProgress`` record held by ``owner_token`` to ``lock_ttl``
        seconds from now on the store's clock: the record's own expiry, or for a record with
        recovery points its lease (its checkpoints untouched), the record then kept at least
        until that lease ends, however soon its retention time would have ended. For such a
        record a ``lock_ttl`` of ``0`` ends the lease now, its retention kept (how
        :class:`StoreBase` leaves a record it took over for a retry to recover).

        A store may also take a keyword ``ttl`` (``renew(key, owner_token, lock_ttl, *,
        ttl=None)``), the route's retention time: a record with recovery points is then kept
        at least ``ttl`` seconds from now, so that it outlives the handler that holds it, and
        a retry after that handler dies still recovers it (the stores of this package take it;
        the middleware passes it to a store whose ``renew`` has the parameter, see
        :func:`renews_retention`). A record's expiry is never brought forward.

        Returns false when the lock is gone, held by someone else, or no longer
        ``InProgress``.
        """
        ...

    async def get(self, key: str) -> IdempotencyRecord | None:
        """The live record under ``key``, if any (for inspection and tests)."""
        ...

    async def aclose(self) -> None:
        """Close what the store opened itself; a client or pool passed in stays open."""
        ...


@runtime_checkable
class OperationClaimingStore(Protocol):
    """A store shared by several processes that keeps their claims on the operations they
    guard, apart from the records: so that two services whose routes share a method and
    template never share records (see ``IdempotencyMiddleware``'s startup).

    An operation is claimed by a holder (one app, from its startup to its shutdown) as served
    by ``code`` (its handler's name). Claims of one code coexist, as the pods of one version;
    a claim lives ``ttl`` seconds on the store's clock from its last renewal.
    """

    async def claim_operation(
        self, operation: str, code: str, holder: str, ttl: float
    ) -> str | None:
        """Claim (or renew the claim on) ``operation`` for ``holder``, in one atomic step.

        Returns ``None`` once claimed. When a live claim of another holder names other code,
        claims nothing and returns that code."""
        ...

    async def release_operation(self, operation: str, holder: str) -> None:
        """End ``holder``'s claim on ``operation`` (nothing when it has none)."""
        ...


#: The operations of :class:`IdempotencyStore`, as the middleware calls them.
STORE_OPERATIONS = (
    "try_acquire",
    "finish",
    "save_progress",
    "release",
    "renew",
    "get",
    "aclose",
)


#: The protocol's first spelling of ``finish`` for each final status (``complete``, ``fail``):
#: what metrics and spans call it, and, until 0.3.0, what :class:`StoreBase` still answers to.
FINISH_SPELLINGS = {RecordStatus.COMPLETED: "complete", RecordStatus.FAILED: "fail"}


def leases_on_store_clock(store: IdempotencyStore) -> bool:
    """Whether ``store`` keeps leases on its own clock, as the protocol asks since 0.2: its
    ``save_progress`` takes the ``lease`` duration.

    A store written before (``save_progress(key, record, ttl)``, reading
    ``record.locked_until``) still works: the middleware sets ``locked_until`` on its own clock
    for it, renews a checkpointed lease by saving the record again, and warns that such leases
    are judged on each pod's clock.
    """
    try:
        parameters = inspect.signature(store.save_progress).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return True
    return "lease" in parameters


def renews_retention(store: IdempotencyStore) -> bool:
    """Whether ``store``'s ``renew`` takes the keyword ``ttl`` (the retention time a renewal
    keeps a record with recovery points for, see :meth:`IdempotencyStore.renew`). A store
    without it keeps working: its renewals keep such a record until its lease ends, or as the
    store decides."""
    try:
        signature = inspect.signature(store.renew)
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return False
    try:  # by keyword beside the three: a store may call its lock TTL ``ttl``
        signature.bind("key", "owner", 1.0, ttl=1.0)
    except TypeError:
        return False
    return True


#: The owner token of the take-back the running task makes (see :func:`take_back`): a store
#: whose ``try_acquire`` undoes a write its caller gave up on leaves that token's write alone.
#: Task-local, so that a store wrapping another (a fault injector, a metrics wrapper) passes it
#: on without knowing of it.
TAKING_BACK: ContextVar[str | None] = ContextVar("starlette_idempotency_taking_back", default=None)


async def take_back(
    store: IdempotencyStore, key: str, record: IdempotencyRecord, lock_ttl: float
) -> AcquireResult:
    """Write ``record`` back for its owner, whose lock vanished while its handler runs (evicted,
    deleted, or lapsed while the process stalled): ``store.try_acquire`` with ``record``
    holding the owner's own token, marked as a take-back (:data:`TAKING_BACK`). With
    recovery: a successor that recovered the key and let it go kept its recovery points and
    ended its lease, which only a recovering acquire takes, and a retry recovering it would run
    beside the handler that still runs.

    The handler still runs, so a call cut short (cancelled, timed out) must not be undone as an
    abandoned acquire is: undone, fenced by the same token, it would free the key of a handler
    that runs, for a retry to run it again."""
    marked = TAKING_BACK.set(record.owner_token)
    try:
        return await store.try_acquire(key, record, lock_ttl)
    finally:
        TAKING_BACK.reset(marked)


class StoreBase(IdempotencyStore):
    """What every store builds on the protocol's primitives; subclass it to write a store.

    Subclasses implement the primitives and set ``name`` and ``supports_recovery``.
    """

    async def resolve(
        self,
        key: str,
        response: StoredResponse,
        ttl: float = DEFAULT_RESOLVED_TTL,
        *,
        owner_token: str | None = None,
    ) -> bool:
        """Finish the record under ``key`` with ``response`` (for operators and reconcilers),
        kept ``ttl`` seconds: whoever holds it, or with ``owner_token`` only the record of
        that owner (the one the caller looked at) and, when it has recovery points, only once
        its lease has run out on the store's clock. Returns false when there is no record to
        resolve, or it changed hands, or its handler holds it again.

        A record whose lease ran out after a recovery point (its handler died, or froze) is
        taken over first, as a retry would take it, and finished under an owner token of its
        own: that handler, were it to wake, cannot store its response over this one. Any other
        record keeps its owner's token, so a handler still running may.

        Raises ``ValueError`` for a ``ttl`` outside :data:`RESOLVED_TTL_RANGE` (a second to a
        hundred years): shorter, the record would be gone before the retry it was held for,
        which would run again; and for a status no replay can send (below 200)."""
        shortest, longest = RESOLVED_TTL_RANGE
        if not shortest <= ttl <= longest:
            raise ValueError(
                f"resolve() keeps a record {shortest:g} to {longest:g} seconds, not {ttl!r}"
            )
        if not 200 <= response.status_code <= 599:
            raise ValueError(
                f"resolve() stores a final response (200 to 599), not {response.status_code}"
            )
        status = RecordStatus.COMPLETED if response.status_code < 400 else RecordStatus.FAILED
        response = replace(response, status_code=int(response.status_code))  # HTTPStatus.OK
        for _ in range(3):
            current = await self.get(key)
            if current is None or owner_token not in (None, current.owner_token):
                return False
            taken = await self._take_over_lapsed(key, current, owner_token)
            if taken is None:
                if owner_token is not None:  # its lease runs, or it changed hands or went
                    return False
                taken = current
            record = taken.finished(status, response, expires_at=time.time() + ttl)
            if await self.finish(key, record, ttl):
                return True
            if owner_token is not None:
                return False
        return False

    async def delete(self, key: str, *, owner_token: str | None = None) -> bool:
        """Delete the record under ``key`` (for operators), so that the next retry runs the
        handler again: whoever holds it, or with ``owner_token`` only the record of that owner
        (the one the caller looked at) and, when it has recovery points, only once its lease
        has run out on the store's clock. Returns false when there is no record to delete, or
        it changed hands, or its handler holds it again.

        A record whose lease ran out after a recovery point is taken over first, as for
        :meth:`resolve`, and deleted under the takeover's token: a transaction that is still
        writing its handler's outcome (``idempotency_transaction``) keeps it, and an outcome
        it committed meanwhile is not deleted."""
        current = await self.get(key)
        if current is None or owner_token not in (None, current.owner_token):
            return False
        taken = await self._take_over_lapsed(key, current, owner_token)
        if taken is None:
            if owner_token is not None:
                return False
            taken = current
        return await self.release(key, taken.owner_token)

    async def _take_over_lapsed(
        self, key: str, current: IdempotencyRecord, owner_token: str | None
    ) -> IdempotencyRecord | None:
        """The record under ``key``, taken over under an owner token of its own, when
        ``current`` (what the caller read) is a record whose lease ran out after a recovery
        point (judged by the store, on its clock, in the takeover); else ``current``.

        ``None`` when its lease runs; and, with ``owner_token`` (the owner the caller looked
        at), when the record changed hands or went since ``current`` was read. A retry may
        have recovered the record in between, saved a further recovery point and ended its
        lease (its handler died too): the takeover then takes that retry's record, whose
        owner was not the one looked at. The takeover says which record it took
        (``AcquireResult.record``, with its owner token and recovery points): what is
        returned is built from it, never from ``current``, which may miss points saved since.
        Without ``owner_token`` (``--force``), whatever the takeover took is acted on."""
        lapsable = current.status is RecordStatus.IN_PROGRESS and current.checkpoints
        if not (self.supports_recovery and lapsable):
            return current
        now = time.time()
        resolver = IdempotencyRecord(
            key=current.key,
            status=RecordStatus.IN_PROGRESS,
            request_fingerprint=current.request_fingerprint,
            owner_token=os.urandom(16).hex(),
            created_at=now,
            expires_at=now + _RESOLVER_LOCK_SECONDS,
            fingerprint_version=current.fingerprint_version,
        )
        taken = await self.try_acquire(key, resolver, _RESOLVER_LOCK_SECONDS)
        if not taken.acquired:
            return None
        recovered = taken.record
        if recovered is None or not recovered.checkpoints:
            # Not a recovery: the record went (deleted, or its retention ended) and the key
            # was acquired afresh, bare.
            if owner_token is None:
                return replace(current, owner_token=resolver.owner_token)
            await self.release(key, resolver.owner_token)
            return None
        if owner_token is not None and recovered.owner_token != owner_token:
            await self._give_back(key, resolver.owner_token)
            return None
        return replace(recovered, owner_token=resolver.owner_token)

    async def _give_back(self, key: str, taker: str) -> None:
        """Leave the record ``taker`` recovered as the takeover found it: its lease run out,
        so that a retry recovers it at once, with all its recovery points (a takeover keeps
        them, and this touches none).

        A renewal to a lease of ``0`` ends the lease now, on the store's clock, and never
        brings the record's expiry forward (the takeover kept it at least as long as it
        was). Not ``save_progress``, whose ``ttl`` sets the retention anew from now: what was
        left of it on the store's clock is not known here (the record's ``expires_at`` is
        data, dated by the clock of the pod that wrote it). The record keeps ``taker``'s
        owner token, as an abandoned recovery keeps its taker's: a lapsed lease is anyone's
        to recover."""
        await self.renew(key, taker, 0.0)

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        """Deprecated (removed in 0.3.0): :meth:`finish`, the protocol's first spelling for a
        ``Completed`` record."""
        deprecated(f"{type(self).__name__}.complete() is finish()")
        return await self.finish(key, record, ttl)

    async def fail(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        """Deprecated (removed in 0.3.0): :meth:`finish`, the protocol's first spelling for a
        ``Failed`` record."""
        deprecated(f"{type(self).__name__}.fail() is finish()")
        return await self.finish(key, record, ttl)


@runtime_checkable
class ConnectionOwningStore(Protocol):
    """A store that says whether it opened its connections itself (``RedisStore.from_url``,
    ``PostgresStore.from_dsn``): the middleware then closes it (:meth:`aclose`) when the
    app's lifespan ends, and lets it open them again (:meth:`reopen`) when the app starts
    again. A store without these, or with a client or pool passed in, is the app's to close."""

    @property
    def owns_connections(self) -> bool: ...

    def reopen(self) -> None:
        """Let a store closed by ``aclose`` open its connections again, on first use."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class CallBatchingStore(Protocol):
    """A store that sends together, itself, the calls made in one turn of the event loop
    (``RedisStore`` on redis-py, in one pipeline). The middleware then sends each of its calls
    at once; for any other store, a call made while others wait on the store goes out a turn
    of the loop later, beside the calls made in that turn."""

    @property
    def batches_calls(self) -> bool:
        """Whether the store sends a turn's acquires and finishes together (it may depend on
        how the store was built)."""
        ...


@runtime_checkable
class ChangeNotifyingStore(Protocol):
    """A store that can announce changes to a key, so waiting duplicates need not poll."""

    async def wait_for_change(self, key: str) -> None:
        """Return once ``key`` was completed, failed, released or resolved (bounded by the
        caller); may also return early, as the caller reads the key again anyway."""
        ...


@dataclass(frozen=True, slots=True)
class HeldRecord:
    """An ``InProgress`` record as an operator lists it (``starlette-idempotency list``)."""

    #: The storage key, without the store's prefix (what :func:`storage_key` built).
    key: str
    record: IdempotencyRecord
    #: Whether the record has recovery points and its lease has run out, on the store's clock:
    #: its handler died after a recovery point, and the key waits for a retry to recover it
    #: (or, with ``on_recovery="hold"``, for an operator to resolve it).
    lease_expired: bool
