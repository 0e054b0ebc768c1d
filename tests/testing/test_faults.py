"""FaultyStore: calls pass through until chosen operations fail or stall, and the wrapper keeps
the wrapped store's capabilities (real Redis and PostgreSQL stores included)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from starlette_idempotency import MemoryStore, StoreError
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from starlette_idempotency.stores.base import (
    ChangeNotifyingStore,
    CheckableStore,
    IdempotencyStore,
    leases_on_store_clock,
)
from starlette_idempotency.testing import FaultyStore
from tests.support.records import finished, pending


@pytest.fixture
def store() -> FaultyStore:
    return FaultyStore(MemoryStore())


async def test_calls_pass_through_and_are_counted(store: FaultyStore) -> None:
    assert (await store.try_acquire("k", pending("k"), 30)).acquired
    assert (await store.get("k")) == await store.inner.get("k")
    assert await store.release("k", "owner-a")
    assert await store.get("k") is None
    assert store.calls == {"try_acquire": 1, "get": 2, "release": 1}


async def test_fail_next_fails_the_next_calls_only(store: FaultyStore) -> None:
    store.fail_next("try_acquire")
    with pytest.raises(StoreError, match="try_acquire failed: injected by FaultyStore"):
        await store.try_acquire("k", pending("k"), 30)
    assert await store.inner.get("k") is None  # the failed call never reached the store
    assert (await store.try_acquire("k", pending("k"), 30)).acquired
    assert await store.get("k") is not None  # other operations were never affected


async def test_fail_next_with_an_error_and_a_count(store: FaultyStore) -> None:
    store.fail_next("get", ConnectionResetError("reset by peer"), times=2)
    for _ in range(2):
        with pytest.raises(ConnectionResetError, match="reset by peer"):
            await store.get("k")
    assert await store.get("k") is None


async def test_fail_always_until_healed(store: FaultyStore) -> None:
    store.fail_always("get")
    store.fail_always("release")
    for _ in range(3):
        with pytest.raises(StoreError):
            await store.get("k")
    store.heal("get")
    assert await store.get("k") is None
    with pytest.raises(StoreError):
        await store.release("k", "owner-a")
    store.heal()
    assert await store.release("k", "owner-a")


def test_unknown_operations_and_counts_are_refused(store: FaultyStore) -> None:
    with pytest.raises(ValueError, match=r"MemoryStore has no operation 'try_aquire'; choose from"):
        store.fail_next("try_aquire")
    with pytest.raises(ValueError, match="times must be at least 1, not 0"):
        store.fail_next("get", times=0)
    assert {"try_acquire", "finish", "wait_for_change", "check"} <= store.operations


async def test_stall_holds_calls_until_the_block_ends(store: FaultyStore) -> None:
    async with store.stall("try_acquire") as stall:
        acquiring = asyncio.create_task(store.try_acquire("k", pending("k"), 30))
        await stall.wait_for_calls(1)
        assert await store.get("k") is None  # another operation goes through meanwhile
        assert not acquiring.done()
    assert (await acquiring).acquired
    assert stall.calls == 1
    assert (await store.try_acquire("k", pending("k", "owner-b"), 30)).acquired is False


async def test_a_stall_without_operations_holds_every_call(store: FaultyStore) -> None:
    async with store.stall() as stall:
        getting = asyncio.create_task(store.get("k"))
        releasing = asyncio.create_task(store.release("k", "owner-a"))
        await stall.wait_for_calls(2)
        assert not getting.done()
        assert not releasing.done()
    assert await getting is None
    assert await releasing


async def test_a_stalled_call_can_be_cancelled_by_its_caller(store: FaultyStore) -> None:
    async with store.stall("get") as stall:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await store.get("k")
    assert stall.calls == 1


async def test_a_stall_then_a_failure(store: FaultyStore) -> None:
    store.fail_next("finish")
    async with store.stall("finish") as stall:
        completing = asyncio.create_task(store.finish("k", pending("k"), 60))
        await stall.wait_for_calls()
    with pytest.raises(StoreError):
        await completing


async def test_complete_and_fail_fault_finish_for_records_of_their_status(
    store: FaultyStore,
) -> None:
    store.fail_always("complete")
    with pytest.raises(StoreError):
        await store.finish("k", finished(pending("k")), 60)
    assert await store.finish("k", finished(pending("k"), status=RecordStatus.FAILED), 60)
    assert store.calls["finish"] == 2
    assert store.calls["complete"] == store.calls["fail"] == 1


def test_resolve_is_refused_with_the_operations_it_is_built_on(store: FaultyStore) -> None:
    with pytest.raises(ValueError, match="fault one of those"):
        store.fail_next("resolve")


async def test_other_methods_and_attributes_are_the_wrapped_stores() -> None:
    inner = MemoryStore(key_prefix="app")
    store = FaultyStore(inner)
    assert store.describe() == inner.describe()
    assert await store.check() == []
    store.fail_next("check")
    with pytest.raises(StoreError):
        await store.check()
    assert repr(store) == f"FaultyStore({inner!r})"
    with pytest.raises(AttributeError):
        store.no_such_attribute  # noqa: B018


@pytest.fixture(
    params=[
        pytest.param("memory_store", id="memory"),
        pytest.param("redis_store", id="redis", marks=pytest.mark.redis),
        pytest.param("postgres_store", id="postgres", marks=pytest.mark.postgres),
    ]
)
def wrapped(request: pytest.FixtureRequest) -> IdempotencyStore:
    """Each kind of store, from the plugin's fixtures for Redis and PostgreSQL."""
    if request.param == "memory_store":
        return MemoryStore()
    store: IdempotencyStore = request.getfixturevalue(request.param)
    return store


async def test_the_wrapper_has_the_wrapped_stores_capabilities(wrapped: IdempotencyStore) -> None:
    store = FaultyStore(wrapped)
    notifies = wrapped.name != "postgres"  # PostgresStore has no change notifications
    assert isinstance(store, IdempotencyStore)
    assert isinstance(store, CheckableStore)
    assert isinstance(store, ChangeNotifyingStore) is notifies
    # Python 3.12+ checks protocols with getattr_static: the methods must be really there.
    assert (inspect.getattr_static(store, "wait_for_change", None) is not None) is notifies
    assert (store.name, store.supports_recovery) == (wrapped.name, wrapped.supports_recovery)
    assert (await store.try_acquire("k", pending("k"), 30)).acquired
    store.fail_next("get")
    with pytest.raises(StoreError):
        await store.get("k")
    record = await store.get("k")
    assert record is not None
    assert record.owner_token == "owner-a"


async def test_a_store_of_the_first_protocol_keeps_its_save_progress() -> None:
    """Wrapping a store whose ``save_progress`` takes no lease (the protocol of 0.1) keeps that
    signature, so the middleware still speaks that protocol to the wrapper; faults apply."""

    class FirstProtocol(MemoryStore):
        async def save_progress(  # type: ignore[override]
            self, key: str, record: IdempotencyRecord, ttl: float
        ) -> bool:
            return await super().save_progress(key, record, ttl, 30)

    modern, first = FaultyStore(MemoryStore()), FaultyStore(FirstProtocol())
    assert leases_on_store_clock(modern)
    assert not leases_on_store_clock(first)
    record = pending("k")
    assert (await first.try_acquire("k", record, 30)).acquired
    first.fail_next("save_progress")
    with pytest.raises(StoreError):
        await first.save_progress("k", record, 60)  # type: ignore[call-arg]
    assert await first.save_progress("k", record, 60)  # type: ignore[call-arg]
    assert first.calls["save_progress"] == 2
