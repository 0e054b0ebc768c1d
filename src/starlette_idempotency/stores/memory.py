"""In-process store for tests, examples and single-process apps.

It is not shared between processes, so it protects nothing across pods or workers. Every
operation runs without an ``await`` between its read and its write, which makes it atomic under
asyncio concurrency without a lock.
"""

from __future__ import annotations

from starlette_idempotency._types import Clock, system_clock
from starlette_idempotency.record import IdempotencyRecord, RecordStatus
from starlette_idempotency.stores.base import DEFAULT_KEY_PREFIX, AcquireResult

_SWEEP_INTERVAL_SECONDS = 60.0


class MemoryStore:
    """A dict of records with TTLs measured on an injectable clock.

    ``clock`` returns seconds; tests pass a fake clock to expire locks and records without
    sleeping. Expired records are invisible at once and swept out periodically.
    """

    name = "memory"

    def __init__(self, *, clock: Clock = system_clock, key_prefix: str = DEFAULT_KEY_PREFIX):
        self._clock = clock
        self._prefix = f"{key_prefix}:"
        self._entries: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._next_sweep = clock() + _SWEEP_INTERVAL_SECONDS

    def __bool__(self) -> bool:
        return True  # a store is never falsy, even while empty

    def __len__(self) -> int:
        """The number of live records."""
        now = self._clock()
        return sum(1 for _, deadline in self._entries.values() if deadline > now)

    def _live(self, key: str, now: float) -> IdempotencyRecord | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._entries[key]
            return None
        return entry[0]

    def _sweep(self, now: float) -> None:
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_INTERVAL_SECONDS
        for key in [k for k, (_, deadline) in self._entries.items() if deadline <= now]:
            del self._entries[key]

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float
    ) -> AcquireResult:
        key = self._prefix + key
        now = self._clock()
        self._sweep(now)
        entry = self._entries.get(key)
        if entry is not None and entry[1] > now:
            return AcquireResult(acquired=False, record=entry[0])
        self._entries[key] = (pending, now + lock_ttl)
        return AcquireResult(acquired=True, record=entry[0] if entry else None)

    def _finish(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        key = self._prefix + key
        now = self._clock()
        current = self._live(key, now)
        if current is not None and current.owner_token != record.owner_token:
            return False
        self._entries[key] = (record, now + ttl)
        return True

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        return self._finish(key, record, ttl)

    async def fail(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        return self._finish(key, record, ttl)

    async def release(self, key: str, owner_token: str) -> bool:
        key = self._prefix + key
        current = self._live(key, self._clock())
        if current is None:
            return True
        if current.owner_token != owner_token:
            return False
        del self._entries[key]
        return True

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        key = self._prefix + key
        now = self._clock()
        current = self._live(key, now)
        if (
            current is None
            or current.owner_token != owner_token
            or current.status is not RecordStatus.IN_PROGRESS
        ):
            return False
        self._entries[key] = (current, now + lock_ttl)
        return True

    async def get(self, key: str) -> IdempotencyRecord | None:
        return self._live(self._prefix + key, self._clock())

    async def aclose(self) -> None:
        self._entries.clear()
