"""In-process store for tests, examples and single-process apps.

It is not shared between processes, so it protects nothing across pods or workers. Every
operation runs without an ``await`` between its read and its write, which makes it atomic under
asyncio concurrency without a lock.

Records are kept packed (``marshal`` bytes beside the few fields the fenced writes compare), not
as objects: an entry of plain bytes, strings and floats is not tracked by the garbage collector,
so a store holding half a million records adds nothing to the collector's walks (as objects,
each full collection walked every record, and the requests in flight waited for it). A lock
just acquired is the exception: its record, of strings and numbers only, is held as it came
until its request settles it, a few milliseconds later (packing it would cost every request
a second ``marshal`` for a value that is replaced before the collector would see it twice).

Recovery points are packed in their JSON wire form, as RedisStore and PostgresStore keep them,
not by ``marshal``, which refuses an enum member, a UUID or a datetime that JSON writes and
keeps what JSON refuses or changes (a number beyond 64 bits, a NaN, a tuple): a handler's
``checkpoint()`` data is saved, refused and read back the same on every store. Records without
recovery points, the most, pay nothing for it.

Locks, leases and expiry are measured on a monotonic clock, so a step of the system clock (an
NTP correction, a VM resumed from a pause) expires nothing; the wall clock only dates what the
records show (``locked_until``).
"""

from __future__ import annotations

import asyncio
import marshal
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    checkpoints_from_wire,
    checkpoints_to_wire,
)
from starlette_idempotency._types import Clock, monotonic_for, system_clock
from starlette_idempotency.stores.base import (
    DEFAULT_KEY_PREFIX,
    AcquireResult,
    FencedWrite,
    StoreBase,
    StoreFinding,
)

_SWEEP_INTERVAL_SECONDS = 60.0

# An entry: (deadline, owner token, whether InProgress, the lease's end for a record with
# recovery points, the packed record, or a lock's record as acquired: see the module docs).
# Deadline and lease are on the monotonic clock.
_Entry = tuple[float, str, bool, float | None, "bytes | IdempotencyRecord"]


def _pack(record: IdempotencyRecord, deadline: float, lease: float | None = None) -> _Entry:
    response = record.response
    fields = (
        record.key,
        str(record.status),  # its value, as a plain str (marshal takes no subclass)
        record.request_fingerprint,
        record.owner_token,
        record.created_at,
        record.expires_at,
        record.fingerprint_version,
        None
        if response is None
        # int(): an HTTPStatus a reconciler's StoredResponse holds is an int subclass
        else (int(response.status_code), response.headers, response.body, response.content_type),
        record.locked_until,
        orjson.dumps(checkpoints_to_wire(record.checkpoints)) if record.checkpoints else b"",
    )
    in_progress = record.status is RecordStatus.IN_PROGRESS
    return deadline, record.owner_token, in_progress, lease, marshal.dumps(fields)


def _acquired(record: IdempotencyRecord, deadline: float) -> _Entry:
    """The entry of a lock just acquired: ``record`` as it is, when it is an ``InProgress``
    record of strings and numbers only (no recovery points, whose data is the user's); else
    packed."""
    if record.checkpoints or record.status is not RecordStatus.IN_PROGRESS:
        return _pack(record, deadline)
    return deadline, record.owner_token, True, None, record


def _unpack(held: bytes | IdempotencyRecord) -> IdempotencyRecord:
    if not isinstance(held, bytes):  # a lock's record as acquired
        return held
    fields: tuple[Any, ...] = marshal.loads(held)
    key, status, fingerprint, owner, created, expires, version, response, lease, points = fields
    # Positional, and the status by lookup: a replay unpacks on every request.
    return IdempotencyRecord(
        key,
        _STATUSES[status],
        fingerprint,
        owner,
        created,
        expires,
        version,
        None if response is None else StoredResponse(*response),
        lease,
        checkpoints_from_wire(orjson.loads(points)) if points else (),
    )


_STATUSES = {status.value: status for status in RecordStatus}


class _Waiting:
    """The waits for a change of one key, and how many there are."""

    __slots__ = ("count", "event")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0


class MemoryStore(StoreBase):
    """A dict of records with TTLs measured on an injectable monotonic clock.

    ``clock`` returns wall time in seconds, which only dates what records show; ``monotonic``
    measures every lock, lease and TTL. It defaults to ``time.monotonic`` beside the system
    clock and to the clock's own ``monotonic`` for a
    :class:`~starlette_idempotency.testing.FakeClock`, so tests expire locks and records by
    advancing a fake clock, without sleeping (an injected clock without a monotonic twin
    measures durations itself). Expired records are invisible at once and swept out
    periodically.
    """

    name = "memory"
    supports_recovery = True

    def __init__(
        self,
        *,
        clock: Clock = system_clock,
        monotonic: Callable[[], float] | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ):
        self._clock = clock
        self._monotonic = monotonic_for(clock) if monotonic is None else monotonic
        self._prefix = f"{key_prefix}:"
        self._entries: dict[str, _Entry] = {}
        self._changes: dict[str, _Waiting] = {}
        self._next_sweep = self._monotonic() + _SWEEP_INTERVAL_SECONDS

    def __bool__(self) -> bool:
        return True  # a store is never falsy, even while empty

    def __len__(self) -> int:
        """The number of live records."""
        now = self._monotonic()
        return sum(1 for entry in self._entries.values() if entry[0] > now)

    def records(self) -> dict[str, IdempotencyRecord]:
        """The live records by key (as the middleware names them: the storage key without the
        store's prefix), for tests and inspection."""
        now, cut = self._monotonic(), len(self._prefix)
        return {
            key[cut:]: _unpack(entry[4]) for key, entry in self._entries.items() if entry[0] > now
        }

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._entries[key]
            return None
        return entry

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + _SWEEP_INTERVAL_SECONDS
        for key in [k for k, entry in self._entries.items() if entry[0] <= now]:
            del self._entries[key]

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        key = self._prefix + key
        now = self._monotonic()
        if now >= self._next_sweep:
            self._sweep(now)
        entry = self._entries.get(key)
        if entry is None or entry[0] <= now:
            self._entries[key] = _acquired(pending, now + lock_ttl)
            if entry is None:
                return AcquireResult(acquired=True)
            # An expired record's recovery points stay behind, as on Redis (the key is gone).
            return AcquireResult(acquired=True, record=replace(_unpack(entry[4]), checkpoints=()))
        deadline, owner, in_progress, lease, packed = entry
        current = _unpack(packed)
        if owner == pending.owner_token and in_progress:
            # Still held by this owner: acquired, as on Redis (where a resent acquire finds it).
            return AcquireResult(acquired=True, record=current if current.checkpoints else None)
        lease_expired = in_progress and lease is not None and now >= lease
        if (
            recover
            and lease_expired
            and current.request_fingerprint == pending.request_fingerprint
            and current.fingerprint_version == pending.fingerprint_version
        ):
            # A handler that checkpointed died: the retry inherits its recovery points, kept
            # at least as long as its lease (the retention may end sooner).
            shown_lease = self._clock() + lock_ttl
            taken = replace(current, owner_token=pending.owner_token, locked_until=shown_lease)
            lease_end = now + lock_ttl
            self._entries[key] = _pack(taken, max(deadline, lease_end), lease_end)
            return AcquireResult(acquired=True, record=current)
        return AcquireResult(acquired=False, record=current, lease_expired=lease_expired)

    def _owned(self, key: str, owner_token: str, now: float) -> _Entry | None:
        """The live ``InProgress`` entry under ``key`` if ``owner_token`` holds it."""
        current = self._live(key, now)
        if current is None or current[1] != owner_token or not current[2]:
            return None
        return current

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        full_key = self._prefix + key
        now = self._monotonic()
        current = self._entries.get(full_key)
        if current is None or current[0] <= now:
            written = FencedWrite.RECLAIMED
        elif current[1] != record.owner_token:
            return FencedWrite.LOST
        else:
            written = FencedWrite.WRITTEN
        self._entries[full_key] = _pack(record, now + ttl)
        if self._changes:  # a duplicate waits in this process: wake it
            self._notify(key)
        return written

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        full_key = self._prefix + key
        now = self._monotonic()
        if self._owned(full_key, record.owner_token, now) is None:
            return False
        shown = replace(record, locked_until=self._clock() + lease)
        self._entries[full_key] = _pack(shown, now + ttl, now + lease)
        return True

    async def release(self, key: str, owner_token: str) -> bool:
        full_key = self._prefix + key
        current = self._live(full_key, self._monotonic())
        if current is None:
            return True
        if current[1] != owner_token:
            return False
        del self._entries[full_key]
        self._notify(key)
        return True

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        """Extend the lock (for a record with recovery points, its lease, and its retention
        to at least the lease's end, or ``ttl`` seconds from now when given)."""
        full_key = self._prefix + key
        now = self._monotonic()
        current = self._owned(full_key, owner_token, now)
        if current is None:
            return False
        deadline, _, _, lease, packed = current
        if lease is None:
            self._entries[full_key] = (now + lock_ttl, *current[1:])
        else:  # a record with recovery points: its lease, and its retention past the lease
            shown = replace(_unpack(packed), locked_until=self._clock() + lock_ttl)
            kept = max(deadline, now + max(lock_ttl, ttl or 0.0))
            self._entries[full_key] = _pack(shown, kept, now + lock_ttl)
        return True

    async def get(self, key: str) -> IdempotencyRecord | None:
        entry = self._live(self._prefix + key, self._monotonic())
        return None if entry is None else _unpack(entry[4])

    async def wait_for_change(self, key: str) -> None:
        """Return once the key is completed, failed, released or resolved (the caller bounds
        the wait). Nothing is left behind when the wait ends, however it ends."""
        waiting = self._changes.get(key)
        if waiting is None:
            waiting = self._changes[key] = _Waiting()
        waiting.count += 1
        try:
            await waiting.event.wait()
        finally:
            waiting.count -= 1
            if not waiting.count and self._changes.get(key) is waiting:
                del self._changes[key]

    def _notify(self, key: str) -> None:
        waiting = self._changes.pop(key, None)
        if waiting is not None:
            waiting.event.set()

    def describe(self) -> str:
        """Where the records are: in this process, shared with no other."""
        return "memory (this process only)"

    async def check(self) -> list[StoreFinding]:
        """Nothing to check: the store is always reachable."""
        return []

    async def aclose(self) -> None:
        self._entries.clear()
