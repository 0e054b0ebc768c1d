"""A MemoryStore made to fail on purpose, for the paths the middleware takes when its store
fails or hangs."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette_idempotency import MemoryStore
from starlette_idempotency.stores import AcquireResult, FencedWrite, IdempotencyRecord


class BrokenStore(MemoryStore):
    """A MemoryStore whose chosen operations fail or hang."""

    def __init__(self, *, failing: set[str], hang: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failing = failing
        self.hang = hang

    async def _maybe_fail(self, operation: str) -> None:
        if operation in self.failing:
            if self.hang:
                await asyncio.Event().wait()
            raise ConnectionError(f"{operation} failed")

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        await self._maybe_fail("try_acquire")
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        await self._maybe_fail("finish")
        return await super().finish(key, record, ttl)
