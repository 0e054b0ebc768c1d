"""MemoryStore specifics beyond the contract: what its self-check says."""

from __future__ import annotations

from starlette_idempotency.stores.base import CheckableStore
from starlette_idempotency.stores.memory import MemoryStore


async def test_the_memory_store_describes_itself_as_this_process_only() -> None:
    store = MemoryStore()

    assert isinstance(store, CheckableStore)
    assert store.describe() == "memory (this process only)"
    assert await store.check() == []
