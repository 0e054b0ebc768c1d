"""A store of your own, in one module that imports from ``starlette_idempotency.stores`` alone.

Records live in a dict here; a real store puts each primitive in one atomic step of its
database (a conditional write, a transaction, a script) and compares the owner token there.
This one is atomic under asyncio because no primitive awaits between its read and its write.
It keeps no recovery points (``supports_recovery = False``): a handler that calls
``checkpoint()`` needs a store that does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from starlette_idempotency.stores import (
    AcquireResult,
    FencedWrite,
    IdempotencyRecord,
    RecordStatus,
    StoreBase,
    StoreError,
    StoreFinding,
)


class DictStore(StoreBase):
    """Records in a dict of this process, each kept until a deadline on ``clock``."""

    name = "dict"
    supports_recovery = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[str, tuple[float, IdempotencyRecord]] | None = {}

    def _table(self) -> dict[str, tuple[float, IdempotencyRecord]]:
        if self._records is None:  # what a store raises when its database cannot answer
            raise StoreError("the dict store is closed")
        return self._records

    def _live(self, key: str) -> IdempotencyRecord | None:
        table = self._table()
        deadline, record = table.get(key, (0.0, None))
        if deadline > self._clock():
            return record
        table.pop(key, None)  # expired: gone for good
        return None

    def _held(self, key: str, owner_token: str) -> IdempotencyRecord | None:
        """The live ``InProgress`` record under ``key`` if ``owner_token`` holds it."""
        record = self._live(key)
        if record is None or record.status is not RecordStatus.IN_PROGRESS:
            return None
        return record if record.owner_token == owner_token else None

    def _keep(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        self._table()[key] = (self._clock() + ttl, record)

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        current = self._live(key)
        if current is None:
            self._keep(key, pending, lock_ttl)
            return AcquireResult(acquired=True)
        if self._held(key, pending.owner_token) is not None:
            return AcquireResult(acquired=True)  # a resent acquire: the key is still ours
        return AcquireResult(acquired=False, record=current, lease_expired=False)

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        current = self._live(key)
        if current is not None and current.owner_token != record.owner_token:
            return FencedWrite.LOST
        self._keep(key, record, ttl)
        return FencedWrite.RECLAIMED if current is None else FencedWrite.WRITTEN

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        if self._held(key, record.owner_token) is None:
            return False
        self._keep(key, replace(record, locked_until=time.time() + lease), ttl)
        return True

    async def release(self, key: str, owner_token: str) -> bool:
        current = self._live(key)
        if current is not None and current.owner_token != owner_token:
            return False
        self._table().pop(key, None)
        return True

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        current = self._held(key, owner_token)
        if current is None:
            return False
        deadline, _ = self._table()[key]
        self._table()[key] = (max(deadline, self._clock() + lock_ttl), current)
        return True

    async def get(self, key: str) -> IdempotencyRecord | None:
        return self._live(key)

    def describe(self) -> str:
        return "dict (this process only)"

    async def check(self) -> list[StoreFinding]:
        return [StoreFinding("warning", "records live in one process: others run a retry again")]

    async def aclose(self) -> None:
        self._records = None
