"""The commands made in one turn of the event loop after its first (acquires' ``SET``,
finishes' script) go to Redis in one pipeline (``PipelinedCommands``), each caller getting its
own reply; a lone command goes out at once; one cancelled before its batch goes out never
reaches Redis; a script the server lost is loaded and sent again."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores import CallBatchingStore, FencedWrite, RecordStatus
from starlette_idempotency.stores.redis import RedisStore
from starlette_idempotency.stores.redis._redis_py import RedisPyDriver
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.conditions import eventually
from tests.support.property.settings import PROPERTY_SETTINGS
from tests.support.records import finished, pending

pytestmark = pytest.mark.redis

LOCK_TTL = 30.0
ROUNDS = 40


class CountedPipelines:
    """A real client whose pipelines are recorded: the command names each sent."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.sent: list[list[str]] = []
        real = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real(*args, **kwargs)
            execute = pipe.execute

            async def recorded(*args: Any, **kwargs: Any) -> Any:
                self.sent.append([str(words[0]) for words, _ in pipe.command_stack])
                return await execute(*args, **kwargs)

            pipe.execute = recorded  # type: ignore[method-assign]
            return pipe

        client.pipeline = pipeline  # type: ignore[method-assign]

    def sizes(self, since: int = 0) -> list[int]:
        return [len(commands) for commands in self.sent[since:]]


@pytest.fixture
async def counted(redis_url: str, redis_key_prefix: str) -> AsyncIterator[tuple[RedisStore, Any]]:
    client = aioredis.from_url(redis_url)
    pipelines = CountedPipelines(client)
    store = RedisStore(client, key_prefix=redis_key_prefix)
    await store.get("warm-up")
    try:
        yield store, pipelines
    finally:
        await store.aclose()  # its undos in flight (which wait for the batches) first
        await client.aclose()


async def test_a_lone_acquire_and_finish_go_out_at_once(counted: tuple[RedisStore, Any]) -> None:
    store, pipelines = counted
    for n in range(3):  # each awaited before the next is made: a turn (and more) apart
        record = pending(f"alone-{n}")
        assert (await store.try_acquire(f"alone-{n}", record, LOCK_TTL)).acquired
        assert await store.finish(f"alone-{n}", finished(record), 60) is FencedWrite.WRITTEN
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
        assert pipelines.sizes(before) == [len(keys) - 1]
        for key, token, result in zip(keys, tokens, results, strict=True):
            if result.acquired:
                assert key not in owners, (key, owners[key])
                owners[key] = token
            else:
                assert result.record is not None
                assert (result.record.key, result.record.owner_token) == (key, owners[key])
        assert set(owners) >= set(keys)


async def test_the_finishes_of_one_turn_go_in_one_pipeline_each_fenced_by_its_own_token(
    counted: tuple[RedisStore, Any],
) -> None:
    """Over many rounds, each finish of a turn writes, is refused (another owner holds the
    key) or finds its key gone, as it would alone; only the turn's first goes out alone."""
    store, pipelines = counted
    rng = random.Random(34)
    for round_number in range(ROUNDS):
        keys = [f"f{round_number}-{n}" for n in range(rng.randrange(2, 10))]
        owned = [pending(key, f"owner-{key}") for key in keys]
        for key, record in zip(keys, owned, strict=True):
            assert (await store.try_acquire(key, record, LOCK_TTL)).acquired
        expected = [rng.choice(list(FencedWrite)) for _ in keys]
        finishing = []
        for key, record, outcome in zip(keys, owned, expected, strict=True):
            if outcome is FencedWrite.RECLAIMED:
                await pipelines.client.delete(store.storage_key(key))
            token = record.owner_token if outcome is not FencedWrite.LOST else "someone-else"
            finishing.append(finished(pending(key, token)))
        before = len(pipelines.sent)
        results = await asyncio.gather(
            *(store.finish(key, record, 60) for key, record in zip(keys, finishing, strict=True))
        )
        assert pipelines.sizes(before) == [len(keys) - 1]
        assert results == expected
        for key, record, outcome in zip(keys, owned, expected, strict=True):
            stored = await store.get(key)
            assert stored is not None
            if outcome is FencedWrite.LOST:  # still the lock of its owner
                assert (stored.status, stored.owner_token) == (
                    RecordStatus.IN_PROGRESS,
                    record.owner_token,
                )
            else:
                assert stored.status is RecordStatus.COMPLETED


async def test_acquires_and_finishes_of_one_turn_share_its_pipeline(
    counted: tuple[RedisStore, Any],
) -> None:
    store, pipelines = counted
    held = pending("held")
    assert (await store.try_acquire("held", held, LOCK_TTL)).acquired
    acquired, written, other = await asyncio.gather(
        store.try_acquire("first", pending("first"), LOCK_TTL),
        store.finish("held", finished(held), 60),
        store.try_acquire("held", pending("held", "a-retry"), LOCK_TTL),
    )
    assert pipelines.sent == [["EVALSHA", "SET"]]  # the first acquire went out alone
    assert acquired.acquired
    assert written is FencedWrite.WRITTEN
    # Commands of a pipeline run in order: the retry finds the finished record.
    assert not other.acquired
    assert other.record is not None
    assert other.record.status is RecordStatus.COMPLETED


async def test_finishes_after_the_server_lost_its_scripts_write(
    counted: tuple[RedisStore, Any],
) -> None:
    """The turn's first finish reloads the script itself (redis-py's script call); the batch
    behind it writes too, whichever of them reaches Redis first."""
    store, pipelines = counted
    records = [pending(f"lost-{n}") for n in range(3)]
    for record in records:
        assert (await store.try_acquire(record.key, record, LOCK_TTL)).acquired
    await pipelines.client.script_flush()
    results = await asyncio.gather(
        *(store.finish(record.key, finished(record), 60) for record in records)
    )
    assert results == [FencedWrite.WRITTEN] * 3
    for record in records:
        stored = await store.get(record.key)
        assert stored is not None
        assert stored.status is RecordStatus.COMPLETED


async def test_a_batch_answered_noscript_loads_the_script_and_sends_those_calls_again(
    counted: tuple[RedisStore, Any],
) -> None:
    """Through the driver's batch alone, so that the server surely answers NOSCRIPT: the
    calls a script the server lost went out in are sent again once it is loaded, and each
    caller gets its own reply."""
    store, pipelines = counted
    for key in ("mine", "theirs"):
        assert (await store.try_acquire(key, pending(key, f"owner-{key}"), LOCK_TTL)).acquired
    await pipelines.client.script_flush()
    batch = RedisPyDriver(pipelines.client).batch
    assert batch is not None
    loop = asyncio.get_running_loop()
    mine, theirs = (store.storage_key(key) for key in ("mine", "theirs"))
    released = await asyncio.gather(
        batch.script("release", mine, ["owner-mine", mine], loop),
        batch.set((store.storage_key("other"), b"{}", "PX", "1000", "NX", "GET"), loop),
        batch.script("release", theirs, ["not-the-owner", theirs], loop),
    )
    assert list(released) == [1, None, 0]
    assert pipelines.sent == [["EVALSHA", "SET", "EVALSHA"], ["EVALSHA", "EVALSHA"]]
    assert await store.get("mine") is None
    assert await store.get("theirs") is not None


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
    assert pipelines.sent == [["SET"]]  # "kept" alone went in the batch
    assert await store.get("later") is None


async def test_a_finish_cancelled_before_its_batch_goes_never_reaches_redis(
    counted: tuple[RedisStore, Any],
) -> None:
    store, pipelines = counted
    records = [pending(name) for name in ("first", "later")]
    for record in records:
        assert (await store.try_acquire(record.key, record, LOCK_TTL)).acquired
    first, later = (
        asyncio.create_task(store.finish(record.key, finished(record), 60)) for record in records
    )
    await asyncio.sleep(0)
    later.cancel()
    assert await first is FencedWrite.WRITTEN
    with pytest.raises(asyncio.CancelledError):
        await later
    assert pipelines.sent == []  # the batch held nothing left to send
    stored = await store.get("later")
    assert stored is not None
    assert stored.status is RecordStatus.IN_PROGRESS


async def test_a_batch_that_fails_fails_each_of_its_commands() -> None:
    """Nothing listens on the port: the lone first acquire and both batched ones each raise
    the store's error, and so do the finishes."""
    store = RedisStore.from_url("redis://127.0.0.1:1/0", key_prefix="nowhere")
    try:
        async with asyncio.timeout(10):  # a batch whose callers are never answered fails here
            results = await asyncio.gather(
                *(store.try_acquire(f"k{n}", pending(f"k{n}"), LOCK_TTL) for n in range(3)),
                *(store.finish(f"k{n}", finished(pending(f"k{n}")), 60) for n in range(3)),
                return_exceptions=True,
            )
    finally:
        await store.aclose()
    assert [type(result) for result in results] == [StoreError] * 6


def batches_in_flight() -> list[asyncio.Task[Any]]:
    return [
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "PipelinedCommands._send"
    ]


async def test_a_batch_whose_callers_all_gave_up_leaves_nothing_waiting_on_a_frozen_redis() -> None:
    """Redis frozen: each caller's deadline passes, as the middleware's would. The batch in
    flight is cancelled then, as a command sent alone is, and no task is left reading from the
    frozen server; once it thaws, the store answers."""
    with RedisServer() as server:
        store = RedisStore.from_url(server.url, key_prefix="frozen")
        await store.get("warm-up")
        server.freeze()
        try:
            results = await asyncio.gather(
                *(
                    asyncio.wait_for(store.try_acquire(f"k{n}", pending(f"k{n}"), LOCK_TTL), 0.2)
                    for n in range(3)
                ),
                return_exceptions=True,
            )
            assert [type(result) for result in results] == [TimeoutError] * 3
            await eventually(
                lambda: not batches_in_flight(), message="the batch in flight to be cancelled"
            )
        finally:
            server.thaw()
        try:
            assert (await store.try_acquire("after", pending("after"), LOCK_TTL)).acquired
        finally:
            await store.aclose()


@pytest.mark.parametrize(
    ("options", "batches"),
    [
        ({}, True),
        ({"acquire": "lua"}, False),  # its acquires go alone: the middleware's turn groups them
        ({"wait_replicas": 1}, False),  # WAIT rides behind each write on its own connection
        ({"driver": "glide"}, False),  # glide pipelines on its one connection itself
    ],
)
def test_the_store_says_when_it_batches_its_calls(
    redis_url: str, options: dict[str, Any], batches: bool
) -> None:
    """What the middleware reads to send each call at once (``CallBatchingStore``)."""
    if options.get("driver") == "glide":
        pytest.importorskip("glide")
    store = RedisStore.from_url(redis_url, **options)
    assert isinstance(store, CallBatchingStore)
    assert store.batches_calls is batches


def test_a_cluster_client_does_not_batch() -> None:
    """A cluster pipeline splits its commands by node: nothing is batched."""
    client = aioredis.RedisCluster(host="127.0.0.1", port=7000)  # connects on first use
    assert RedisStore(client).batches_calls is False


#: One command of a turn: an acquire or a finish, of a key, by an owner, and whether its caller
#: gives up before the turn's batch goes out.
Command = tuple[str, str, str, bool]

turns = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "finish"]),
        st.sampled_from(["k0", "k1", "k2"]),
        st.sampled_from(["a", "b", "c"]),
        st.booleans(),
    ),
    min_size=1,
    max_size=9,
)


async def run_command(store: RedisStore, command: Command) -> tuple[object, ...]:
    """What ``command`` answers, as far as it is the same whoever sends it, how and when."""
    kind, key, owner, gives_up = command
    if kind == "acquire":
        # Each request's token is its own (os.urandom's): the store undoes an acquire given up
        # by its token, which must not be another acquire's still waiting in the turn.
        token = f"{owner}-gave-up" if gives_up else owner
        result = await store.try_acquire(key, pending(key, token, now=0.0), LOCK_TTL)
        record = result.record
        return (result.acquired, None if record is None else (record.status, record.owner_token))
    return (await store.finish(key, finished(pending(key, owner, now=0.0)), 60),)


async def final_records(store: RedisStore) -> dict[str, tuple[RecordStatus, str] | None]:
    records = {key: await store.get(key) for key in ("k0", "k1", "k2")}
    return {
        key: None if record is None else (record.status, record.owner_token)
        for key, record in records.items()
    }


@PROPERTY_SETTINGS
@given(turns)
async def test_a_turn_sent_together_answers_as_its_commands_sent_one_by_one(
    redis_url: str, commands: list[Command]
) -> None:
    """Whatever a turn holds (acquires and finishes of the same keys by different owners,
    callers giving up before the batch goes out), each caller's answer and the records left
    are those of the same commands sent one at a time, in the order they were made, without the
    ones given up. The turn's first command, sent alone on another connection, touches a key of
    its own, as Redis may read two connections in either order."""
    tag = uuid.uuid4().hex[:8]
    together = RedisStore.from_url(redis_url, key_prefix=f"together-{tag}")
    one_by_one = RedisStore.from_url(redis_url, key_prefix=f"one-by-one-{tag}")
    try:
        await together.get("warm-up")  # the client's loop entered, as in a request
        first = asyncio.ensure_future(together.try_acquire("opener", pending("opener"), LOCK_TTL))
        made = [asyncio.ensure_future(run_command(together, command)) for command in commands]
        await asyncio.sleep(0)  # each has made its call: the opener sent, the rest queued
        for task, (_, _, _, gives_up) in zip(made, commands, strict=True):
            if gives_up:
                task.cancel()
        assert (await first).acquired
        answers = await asyncio.gather(*made, return_exceptions=True)
        expected = [
            await run_command(one_by_one, command) for command in commands if not command[3]
        ]
        assert [answer for answer in answers if not isinstance(answer, asyncio.CancelledError)] == (
            expected
        )
        assert await final_records(together) == await final_records(one_by_one)
    finally:
        await together.aclose()
        await one_by_one.aclose()


class GatedPipelines:
    """A real client whose pipelines wait for ``gate`` before they go out, as one waiting for
    a new connection (a slow handshake, TLS) or retrying after a reset does; its scripts' loads
    wait for ``loads``."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.gate = asyncio.Event()
        self.loads = asyncio.Event()
        real_pipeline, real_load = client.pipeline, client.script_load

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real_pipeline(*args, **kwargs)
            execute = pipe.execute

            async def gated(*args: Any, **kwargs: Any) -> Any:
                await self.gate.wait()
                return await execute(*args, **kwargs)

            pipe.execute = gated  # type: ignore[method-assign]
            return pipe

        async def load(script: Any) -> Any:
            await self.loads.wait()
            return await real_load(script)

        client.pipeline = pipeline  # type: ignore[method-assign]
        client.script_load = load  # type: ignore[method-assign]


async def test_an_acquire_given_up_in_a_batch_is_undone_once_the_batch_has_ended(
    redis_url: str, redis_key_prefix: str
) -> None:
    """The batch has taken the acquire (its caller then still waited) and waits for its
    connection when the caller gives up; another caller of the batch still waits, so the batch
    goes on and writes it. Undone while the batch waited, the write would land after its undo:
    a lock nobody holds, answering retries 409 for its whole TTL."""
    client = aioredis.from_url(redis_url)
    pipelines = GatedPipelines(client)
    store = RedisStore(client, key_prefix=redis_key_prefix)
    undone: list[str] = []
    eval_script = store._driver.eval_script

    async def recorded(name: str, *args: Any) -> Any:
        undone.append(name)
        return await eval_script(name, *args)

    store._driver.eval_script = recorded  # type: ignore[method-assign,assignment]
    try:
        await store.get("warm-up")
        opener = asyncio.ensure_future(store.try_acquire("opener", pending("opener"), LOCK_TTL))
        live = asyncio.ensure_future(store.try_acquire("live", pending("live"), LOCK_TTL))
        gone = asyncio.ensure_future(store.try_acquire("gone", pending("gone"), LOCK_TTL))
        assert (await opener).acquired  # sent at once; the other two wait in the batch
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert store._undoing
        for _ in range(3):  # the undo's first steps: an undo at once would be made in them
            await asyncio.sleep(0)
        assert undone == []  # none while the batch that may still send the write waits
        pipelines.gate.set()
        assert (await live).acquired
        await eventually(lambda: not store._undoing, message="the undo")
        assert undone == ["abandon", "abandon"]
        assert await client.exists(store.storage_key("gone")) == 0
        assert await client.exists(store.storage_key("live")) == 1
    finally:
        pipelines.gate.set()
        await store.aclose()
        await client.aclose()


async def test_a_batch_whose_callers_gave_up_while_it_loads_a_script_ends() -> None:
    """Scripts flushed: the batch's finishes come back NOSCRIPT, and the batch loads the
    script; its callers' deadlines pass while the load waits (a server gone silent). The batch
    ends then too, rather than wait on the load for ever with a pooled connection."""
    with RedisServer() as server:
        client = aioredis.from_url(server.url)
        pipelines = GatedPipelines(client)
        pipelines.gate.set()
        store = RedisStore(client, key_prefix="loading")
        try:
            await store.get("warm-up")
            await client.script_flush()
            results = await asyncio.gather(
                asyncio.wait_for(store.try_acquire("k0", pending("k0"), LOCK_TTL), 0.5),
                *(
                    asyncio.wait_for(store.finish(f"k{n}", finished(pending(f"k{n}")), 60), 0.5)
                    for n in (1, 2)
                ),
                return_exceptions=True,
            )
            assert [type(result) for result in results[1:]] == [TimeoutError] * 2
            await eventually(
                lambda: not batches_in_flight(), message="the batch loading the script to end"
            )
        finally:
            pipelines.loads.set()
            await store.aclose()
            await client.aclose()
