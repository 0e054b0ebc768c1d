"""The acquires made in one turn of the event loop after its first go to Redis in one pipeline
(``PipelinedSets``), each caller getting its own reply; a lone acquire goes out at once; an
acquire cancelled before its batch goes out never reaches Redis."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores.redis import RedisStore
from tests.support.records import pending

pytestmark = pytest.mark.redis

LOCK_TTL = 30.0
ROUNDS = 40


class CountedPipelines:
    """A real client whose pipelines are counted, with the commands each sent."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.sent: list[int] = []
        real = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            async def counted(*args: Any, **kwargs: Any) -> Any:
                self.sent.append(len(pipe.command_stack))
                return await execute(*args, **kwargs)

            pipe.execute = counted  # type: ignore[method-assign]
            return pipe

        client.pipeline = pipeline  # type: ignore[method-assign]


@pytest.fixture
async def counted(redis_url: str, redis_key_prefix: str) -> AsyncIterator[tuple[RedisStore, Any]]:
    client = aioredis.from_url(redis_url)
    pipelines = CountedPipelines(client)
    store = RedisStore(client, key_prefix=redis_key_prefix)
    await store.get("warm-up")
    try:
        yield store, pipelines
    finally:
        await client.aclose()


async def test_a_lone_acquire_goes_out_at_once(counted: tuple[RedisStore, Any]) -> None:
    store, pipelines = counted
    for n in range(3):  # each awaited before the next is made: a turn (and more) apart
        assert (await store.try_acquire(f"alone-{n}", pending(f"alone-{n}"), LOCK_TTL)).acquired
    assert pipelines.sent == []


async def test_the_acquires_of_one_turn_go_in_one_pipeline_with_their_own_replies(
    counted: tuple[RedisStore, Any],
) -> None:
    """Over many rounds of random keys, some free, some held by an earlier round: the first
    acquire of a turn goes out alone and the rest in one pipeline, and each caller's answer is
    about its own key."""
    store, pipelines = counted
    rng = random.Random(33)
    owners: dict[str, str] = {}
    for round_number in range(ROUNDS):
        keys = [f"k-{rng.randrange(60)}" for _ in range(rng.randrange(2, 12))]
        tokens = [f"r{round_number}-{n}" for n in range(len(keys))]
        before = len(pipelines.sent)
        results = await asyncio.gather(
            *(
                store.try_acquire(key, pending(key, token), LOCK_TTL)
                for key, token in zip(keys, tokens, strict=True)
            )
        )
        assert pipelines.sent[before:] == [len(keys) - 1]
        for key, token, result in zip(keys, tokens, results, strict=True):
            if result.acquired:
                assert key not in owners, (key, owners[key])
                owners[key] = token
            else:
                assert result.record is not None
                assert (result.record.key, result.record.owner_token) == (key, owners[key])
        assert set(owners) >= set(keys)


async def test_an_acquire_cancelled_before_its_batch_goes_never_reaches_redis(
    counted: tuple[RedisStore, Any],
) -> None:
    store, pipelines = counted
    first = asyncio.create_task(store.try_acquire("first", pending("first"), LOCK_TTL))
    later = asyncio.create_task(store.try_acquire("later", pending("later"), LOCK_TTL))
    kept = asyncio.create_task(store.try_acquire("kept", pending("kept"), LOCK_TTL))
    await asyncio.sleep(0)  # each has made its call: the first sent, the others queued
    later.cancel()
    assert (await first).acquired
    assert (await kept).acquired
    with pytest.raises(asyncio.CancelledError):
        await later
    assert pipelines.sent == [1]  # "kept" alone went in the batch
    assert await store.get("later") is None


async def test_a_batch_that_fails_fails_each_of_its_acquires() -> None:
    """Nothing listens on the port: the lone first acquire and both batched ones each raise
    the store's error."""
    store = RedisStore.from_url("redis://127.0.0.1:1/0", key_prefix="nowhere")
    try:
        async with asyncio.timeout(10):  # a batch whose callers are never answered fails here
            results = await asyncio.gather(
                *(store.try_acquire(f"k{n}", pending(f"k{n}"), LOCK_TTL) for n in range(3)),
                return_exceptions=True,
            )
    finally:
        await store.aclose()
    assert [type(result) for result in results] == [StoreError] * 3
