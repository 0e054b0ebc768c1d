"""RedisStore specifics: wire form, key layout, round trips, fallback, errors, cancellation, WAIT.

Tests that stop, freeze or pause a server use ``private_redis``; the others share ``redis_url``
under a prefix of their own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from glide import GlideError
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from starlette_idempotency._record import (
    Checkpoint,
    RecordStatus,
    StoredResponse,
    dump_record,
    record_to_dict,
)
from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.testing._redis_server import RedisServer, encode_command
from tests.support.conditions import eventually
from tests.support.records import LOCK_TTL, RETENTION_TTL, finished, pending
from tests.support.stores import (
    DRIVERS,
    STRATEGIES,
    answers,
    command_calls,
    commands_sent,
    equals,
    glide_client,
    replica_waiting_store,
    timed_acquire,
)

pytestmark = pytest.mark.redis


def no_retry() -> Retry:
    return Retry(NoBackoff(), retries=0)


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A raw client on the shared Redis, to look at what the store wrote."""
    raw = aioredis.from_url(redis_url)
    yield raw
    await raw.aclose()


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"key_prefix": "tenant{1}"},
        {"key_prefix": "a}b"},
        {"acquire": "cas"},
        {"wait_replicas": -1},
        {"wait_replicas": 1, "wait_timeout_ms": 0},
    ],
)
async def test_invalid_options_raise_configuration_error(
    redis_url: str, options: dict[str, Any]
) -> None:
    with pytest.raises(ConfigurationError):
        RedisStore.from_url(redis_url, **options)


async def test_store_is_named_redis_and_implements_the_protocol(redis_url: str) -> None:
    store = RedisStore.from_url(redis_url)
    try:
        assert store.name == "redis"
        assert isinstance(store, IdempotencyStore)
        assert store.storage_key("POST:/x") == "idempotency:POST:/x"
    finally:
        await store.aclose()


# -- wire form and key layout ----------------------------------------------------------------


@STRATEGIES
async def test_value_is_exactly_the_record_wire_form(
    client: aioredis.Redis, redis_key_prefix: str, acquire: AcquireStrategy
) -> None:
    store = RedisStore(client, key_prefix=redis_key_prefix, acquire=acquire)
    record = pending("k", "owner-a")
    await store.try_acquire("k", record, LOCK_TTL)

    raw = await client.get(f"{redis_key_prefix}:k")
    assert raw == dump_record(record)
    assert orjson.loads(raw) == record_to_dict(record)
    assert 0 < await client.pttl(f"{redis_key_prefix}:k") <= LOCK_TTL * 1000

    done = finished(record, body=b"\x00\xffbinary")
    assert await store.finish("k", done, RETENTION_TTL)
    raw = await client.get(f"{redis_key_prefix}:k")
    assert raw == dump_record(done)
    assert orjson.loads(raw)["responseBodyEncoding"] == "base64"
    assert LOCK_TTL * 1000 < await client.pttl(f"{redis_key_prefix}:k") <= RETENTION_TTL * 1000


async def test_key_layout_is_prefix_colon_key(
    client: aioredis.Redis, redis_key_prefix: str
) -> None:
    store = RedisStore(client, key_prefix=redis_key_prefix)
    key = "POST:/orders:tenant%3A1:ключ"
    await store.try_acquire(key, pending(key, "owner-a"), LOCK_TTL)

    keys = [k async for k in client.scan_iter(match=f"{redis_key_prefix}:*")]
    assert keys == [f"{redis_key_prefix}:{key}".encode()]


async def test_a_tiny_ttl_still_sets_an_expiry(
    client: aioredis.Redis, redis_key_prefix: str
) -> None:
    store = RedisStore(client, key_prefix=redis_key_prefix)
    # PX 0 would be rejected by Redis: the store rounds up to one millisecond.
    assert (await store.try_acquire("k", pending("k", "owner-a"), 0.0001)).acquired


async def test_a_record_rewritten_in_its_last_millisecond_keeps_an_expiry(
    client: aioredis.Redis, redis_key_prefix: str
) -> None:
    """A script reads PTTL 0 in the key's last millisecond: it took that for a key without a
    TTL and wrote the record with none, so a renewal or a recovery then kept it for ever (a
    reused key answered 422 for good). Each round arrives in that millisecond and renews."""
    store = RedisStore(client, key_prefix=redis_key_prefix)
    for round_ in range(20):
        key = f"k{round_}"
        record = pending(key, "owner-a")
        assert (await store.try_acquire(key, record, LOCK_TTL)).acquired
        saved = replace(record, checkpoints=(Checkpoint("sent", [], time.time()),))
        assert await store.save_progress(key, saved, 0.02, 10.0)
        while await client.pttl(f"{redis_key_prefix}:{key}") > 0:
            pass
        await store.renew(key, "owner-a", 10.0)
        assert await client.pttl(f"{redis_key_prefix}:{key}") != -1, f"round {round_}"


@STRATEGIES
async def test_client_with_decoded_responses(
    redis_url: str, redis_key_prefix: str, acquire: AcquireStrategy
) -> None:
    decoding = aioredis.from_url(redis_url, decode_responses=True)
    store = RedisStore(decoding, key_prefix=redis_key_prefix, acquire=acquire)
    try:
        first = pending("k", "owner-a")
        assert (await store.try_acquire("k", first, LOCK_TTL)).acquired
        conflict = await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)
        assert conflict.record is not None
        assert conflict.record.owner_token == "owner-a"
        assert await store.finish("k", finished(first, body=b"\xfe"), RETENTION_TTL)
        stored = await store.get("k")
        assert stored is not None
        assert stored.response is not None
        assert stored.response.body == b"\xfe"
    finally:
        await decoding.aclose()


# -- round trips -------------------------------------------------------------------------------


@pytest.fixture
async def private_client(private_redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    raw = aioredis.from_url(private_redis.url)
    await raw.ping()  # connected (HELLO, CLIENT SETINFO) before anything is counted
    yield raw
    await raw.aclose()


async def test_setnx_acquire_and_conflict_take_one_command_each(
    admin: aioredis.Redis, private_client: aioredis.Redis
) -> None:
    store = RedisStore(private_client, key_prefix="p")

    first = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "a"), 30))
    conflict = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "b"), 30))

    assert first == {"set": 1}
    assert conflict == {"set": 1}


async def test_lua_acquire_and_conflict_take_one_command_each(
    admin: aioredis.Redis, private_client: aioredis.Redis
) -> None:
    store = RedisStore(private_client, key_prefix="p", acquire="lua")
    await store.try_acquire("warm", pending("warm", "a"), 30)  # loads the script once

    first = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "a"), 30))
    conflict = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "b"), 30))

    # The script's own GET and SET count as commands too, but cost no round trip.
    assert first == {"evalsha": 1, "get": 1, "set": 1}
    assert conflict == {"evalsha": 1, "get": 1}


async def test_fallback_acquires_with_set_nx_then_get(
    admin: aioredis.Redis, private_client: aioredis.Redis
) -> None:
    store = RedisStore(private_client, key_prefix="p")
    # What a Redis < 7 leaves behind after rejecting SET NX GET:
    assert store._fall_back_from_nx_get(ResponseError("ERR syntax error"))
    first = pending("k", "owner-a")

    acquired = await commands_sent(admin, lambda: store.try_acquire("k", first, 30))
    result = await store.try_acquire("k", pending("k", "owner-b"), 30)
    conflict = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "c"), 30))

    assert acquired == {"set": 1}
    assert conflict == {"set": 1, "get": 1}
    assert not result.acquired
    assert result.record is not None
    assert record_to_dict(result.record) == record_to_dict(first)
    assert (await store.get("k")) is not None


async def test_only_a_syntax_error_switches_to_the_fallback(
    private_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore(private_client, key_prefix="p")

    assert not store._fall_back_from_nx_get(ResponseError("WRONGTYPE Operation against a key"))
    assert store._nx_get
    with caplog.at_level(logging.INFO, logger="starlette_idempotency"):
        assert store._fall_back_from_nx_get(ResponseError("ERR syntax error"))
        assert not store._nx_get
        # A call sent with GET before the switch, and rejected after it, falls back too.
        assert store._fall_back_from_nx_get(ResponseError("ERR syntax error"))
    assert [r.message for r in caplog.records].count(
        "Redis rejected SET NX GET (ERR syntax error); acquiring with SET NX, then GET"
    ) == 1


@pytest.fixture(params=["redis-py", "glide"])
async def any_private_client(
    request: pytest.FixtureRequest, private_redis: RedisServer
) -> AsyncIterator[Any]:
    """A client of either driver on the private Redis, connected."""
    if request.param == "redis-py":
        client = aioredis.from_url(private_redis.url)
        await client.ping()
        yield client
        await client.aclose()
    else:
        glide = await glide_client(private_redis.url)
        yield glide
        await glide.close()


async def test_scripts_are_reloaded_after_script_flush(
    admin: aioredis.Redis, any_private_client: Any
) -> None:
    store = RedisStore(any_private_client, key_prefix="p", acquire="lua")
    record = pending("k", "owner-a")
    assert (await store.try_acquire("k", record, 30)).acquired

    await admin.script_flush()

    assert not (await store.try_acquire("k", pending("k", "owner-b"), 30)).acquired
    assert await store.renew("k", "owner-a", 30)
    assert await store.finish("k", finished(record), 60)
    assert await store.release("k", "owner-a")


# -- errors ------------------------------------------------------------------------------------


@DRIVERS
async def test_malformed_or_foreign_values_raise_store_error(
    client: aioredis.Redis, redis_url: str, redis_key_prefix: str, driver: DriverName
) -> None:
    store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix, driver=driver)
    await client.set(f"{redis_key_prefix}:junk", b"not json {")
    await client.set(f"{redis_key_prefix}:array", b"[1, 2]")
    await client.rpush(f"{redis_key_prefix}:list", b"x")
    record = pending("junk", "owner-a")

    for key in ("junk", "array", "list"):
        with pytest.raises(StoreError):
            await store.get(key)
        with pytest.raises(StoreError):
            await store.try_acquire(key, record, LOCK_TTL)
        with pytest.raises(StoreError):
            await store.finish(key, finished(record), RETENTION_TTL)
        with pytest.raises(StoreError):
            await store.release(key, "owner-a")
        with pytest.raises(StoreError):
            await store.renew(key, "owner-a", LOCK_TTL)
    await store.aclose()


def all_operations(store: RedisStore) -> list[Callable[[], Awaitable[Any]]]:
    record = pending("k", "owner-a")
    return [
        lambda: store.try_acquire("k", record, LOCK_TTL),
        lambda: store.finish("k", finished(record), RETENTION_TTL),
        lambda: store.finish("k", finished(record, status=RecordStatus.FAILED), RETENTION_TTL),
        lambda: store.release("k", "owner-a"),
        lambda: store.renew("k", "owner-a", LOCK_TTL),
        lambda: store.get("k"),
    ]


#: Per driver: no retries of its own and short timeouts, so an outage shows at once.
QUICK_FAILURES: dict[DriverName, Callable[[], dict[str, Any]]] = {
    "redis-py": lambda: {"socket_timeout": 0.2, "retry": no_retry()},
    "glide": lambda: {"request_timeout": 200},
}
#: What the StoreError of a stopped server is caused by, per driver.
CONNECTION_ERRORS: dict[DriverName, type[BaseException]] = {
    "redis-py": RedisConnectionError,
    "glide": GlideError,
}


@STRATEGIES
@DRIVERS
async def test_a_stopped_server_raises_store_error_and_the_store_recovers(
    private_redis: RedisServer, acquire: AcquireStrategy, driver: DriverName
) -> None:
    store = RedisStore.from_url(
        private_redis.url, acquire=acquire, driver=driver, **QUICK_FAILURES[driver]()
    )
    try:
        assert (await store.try_acquire("warm", pending("warm", "a"), LOCK_TTL)).acquired
        private_redis.stop()

        for operation in all_operations(store):
            with pytest.raises(StoreError) as caught:
                await operation()
            assert isinstance(caught.value.__cause__, CONNECTION_ERRORS[driver])

        private_redis.start()
        # glide reconnects in the background, with backoff
        await eventually(lambda: answers(store), timeout=10, message="the store to reconnect")
        record = pending("k", "owner-a")
        assert (await store.try_acquire("k", record, LOCK_TTL)).acquired
        assert await store.finish("k", finished(record), RETENTION_TTL)
        stored = await store.get("k")
        assert stored is not None
        assert stored.status is RecordStatus.COMPLETED
    finally:
        await store.aclose()


@DRIVERS
async def test_a_hung_server_raises_store_timeout_error(
    private_redis: RedisServer, driver: DriverName
) -> None:
    store = RedisStore.from_url(private_redis.url, driver=driver, **QUICK_FAILURES[driver]())
    try:
        await store.get("warm")
        private_redis.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(StoreTimeoutError):
                await store.get("k")
            assert time.monotonic() - started < 2.0
        finally:
            private_redis.thaw()
        await eventually(lambda: answers(store), message="the thawed server to answer")
        assert (await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)).acquired
    finally:
        await store.aclose()


# -- cancellation ------------------------------------------------------------------------------


async def blocked_clients(admin: aioredis.Redis) -> int:
    info: dict[str, Any] = await admin.info("clients")
    return int(info["blocked_clients"])


@pytest.mark.parametrize("wait_replicas", [0, 1], ids=["no-wait", "wait"])
@STRATEGIES
async def test_a_call_cancelled_mid_flight_leaves_nothing_behind(
    private_redis: RedisServer,
    admin: aioredis.Redis,
    acquire: AcquireStrategy,
    wait_replicas: int,
) -> None:
    """The middleware's ``asyncio.timeout`` cancels a call while Redis holds it (CLIENT PAUSE).

    The cancelled connection must not go back to the pool with a reply still owed (the next
    call would read it), and the held SET must never run once Redis resumes. (A paused
    client's command is dropped with its connection; one still in the socket buffer is not:
    see test_redis_stall.py.)
    """
    client = aioredis.from_url(private_redis.url, max_connections=1, client_name="store")
    store = RedisStore(client, key_prefix="p", acquire=acquire, wait_replicas=wait_replicas)
    await client.set("p:other", b"other-value")
    await store.try_acquire("warm", pending("warm", "a"), LOCK_TTL)  # scripts loaded
    # A control connection whose write is held too and which stays open: it must run later.
    control = socket.create_connection(("127.0.0.1", private_redis.port))
    try:
        await admin.client_pause(10_000, all=False)  # hold writes only
        control.sendall(encode_command("SET", "p:control", "ran"))

        async def bounded_call() -> None:
            async with asyncio.timeout(0.5):  # as the middleware bounds store calls
                await store.try_acquire("k", pending("k", "owner-a"), LOCK_TTL)

        call = asyncio.create_task(bounded_call())
        await eventually(
            lambda: equals(blocked_clients(admin), 2), message="both writes held by the pause"
        )
        with pytest.raises(TimeoutError):
            await call
        # The store's connection was closed, so Redis drops its held command with it.
        await eventually(lambda: acquire_gone(admin), message="the cancelled client gone")
        await admin.client_unpause()
        await eventually(
            lambda: equals(admin.get("p:control"), b"ran"), message="the control write to run"
        )
        # The store's undo of the abandoned acquire: two fenced releases (EVAL), no-ops here.
        await eventually(lambda: equals(eval_calls(admin), 2), message="the undo to finish")

        assert await admin.get("p:k") is None, "the cancelled acquire ran after all"
        pool: Any = client.connection_pool
        assert not pool._in_use_connections
        assert await client.get("p:other") == b"other-value"
        assert await store.get("k") is None
        assert (await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)).acquired
        assert await client.get("p:other") == b"other-value"
    finally:
        control.close()
        await store.aclose()
        await client.aclose()


async def acquire_gone(admin: aioredis.Redis) -> bool:
    """Whether no connection of the store's (named ``store``) holds an acquire any more."""
    clients: list[dict[str, Any]] = await admin.client_list()
    return not any(
        c.get("name") == "store" and c.get("cmd") in ("set", "evalsha", "wait") for c in clients
    )


async def eval_calls(admin: aioredis.Redis) -> int:
    return (await command_calls(admin)).get("eval", 0)


# -- WAIT --------------------------------------------------------------------------------------


@STRATEGIES
async def test_wait_replicas_without_a_replica_returns_within_the_timeout(
    client: aioredis.Redis,
    redis_key_prefix: str,
    acquire: AcquireStrategy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = replica_waiting_store(client, redis_key_prefix, acquire, wait_timeout_ms=200)
    record = pending("k", "owner-a")

    result, elapsed = await timed_acquire(store, record, caplog)

    assert result.acquired, "too few replicas is logged, not an error"
    assert 0.15 < elapsed < 2.0
    assert "0 of 1 Redis replicas acknowledged" in caplog.text
    assert await client.get(f"{redis_key_prefix}:k") == dump_record(record)
    conflict = await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)
    assert conflict.record is not None
    assert conflict.record.owner_token == "owner-a"


async def test_wait_is_sent_on_the_acquire_and_the_finish_only_when_asked(
    admin: aioredis.Redis, private_client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    plain = RedisStore(private_client, key_prefix="plain")
    waiting = RedisStore(private_client, key_prefix="wait", wait_replicas=1, wait_timeout_ms=10)
    record = pending("k", "a")

    assert await commands_sent(admin, lambda: plain.try_acquire("k", record, 30)) == {"set": 1}
    assert await commands_sent(admin, lambda: waiting.try_acquire("k", record, 30)) == {
        "set": 1,
        "wait": 1,
    }
    plain_finish = await commands_sent(admin, lambda: plain.finish("k", finished(record), 60))
    assert "wait" not in plain_finish
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency.stores.redis"):
        finish = await commands_sent(admin, lambda: waiting.finish("k", finished(record), 60))
    assert finish["wait"] == 1
    assert "0 of 1 Redis replicas acknowledged the response" in caplog.text


async def test_wait_with_lua_reloads_a_flushed_script(
    admin: aioredis.Redis, private_client: aioredis.Redis
) -> None:
    store = RedisStore(
        private_client, key_prefix="p", acquire="lua", wait_replicas=1, wait_timeout_ms=10
    )
    await admin.script_flush()

    assert (await store.try_acquire("k", pending("k", "owner-a"), 30)).acquired
    assert not (await store.try_acquire("k", pending("k", "owner-b"), 30)).acquired


async def test_wait_with_the_fallback(
    admin: aioredis.Redis, private_client: aioredis.Redis
) -> None:
    store = RedisStore(private_client, key_prefix="p", wait_replicas=1, wait_timeout_ms=10)
    assert store._fall_back_from_nx_get(ResponseError("ERR syntax error"))  # a Redis < 7
    first = pending("k", "owner-a")

    assert (await store.try_acquire("k", first, 30)).acquired
    conflict = await store.try_acquire("k", pending("k", "owner-b"), 30)
    assert conflict.record is not None
    assert record_to_dict(conflict.record) == record_to_dict(first)


# -- client ownership --------------------------------------------------------------------------


async def test_aclose_leaves_a_client_passed_in_open(client: aioredis.Redis) -> None:
    connection_id = await client.client_id()
    store = RedisStore(client)

    await store.aclose()

    assert await client.client_id() == connection_id  # same connection, still open


async def test_aclose_closes_a_client_from_url(
    private_redis: RedisServer, admin: aioredis.Redis
) -> None:
    async def connected_clients() -> int:
        info: dict[str, Any] = await admin.info("clients")
        return int(info["connected_clients"])

    store = RedisStore.from_url(private_redis.url)
    await store.get("k")
    assert await connected_clients() == 2

    await store.aclose()

    await eventually(
        lambda: equals(connected_clients(), 1), message="the store's connection to close"
    )


@STRATEGIES
async def test_takeover_with_wait_after_script_flush(
    admin: aioredis.Redis, private_client: aioredis.Redis, acquire: AcquireStrategy
) -> None:
    store = RedisStore(
        private_client, key_prefix="p", acquire=acquire, wait_replicas=1, wait_timeout_ms=10
    )
    dead = pending("k", "dead-owner")
    assert (await store.try_acquire("k", dead, 30)).acquired
    saved = replace(dead, checkpoints=(Checkpoint("sent", [], time.time()),))
    assert await store.save_progress("k", saved, 60, 0)  # its lease ends now
    await admin.script_flush()

    sent = await commands_sent(admin, lambda: store.try_acquire("k", pending("k", "b"), 30))

    # WAIT behind the acquire and behind the takeover, plus one per pipeline resent after
    # NOSCRIPT (the failed pipeline's WAIT ran too).
    assert sent["wait"] == 2 + sent["script|load"]
    stored = await store.get("k")
    assert stored is not None
    assert stored.owner_token == "b"
    assert stored.checkpoints[0].data == []
    assert 59_000 < await private_client.pttl("p:k") <= 60_000  # the record's TTL is kept


# -- resolve -----------------------------------------------------------------------------------


async def test_resolve_finishes_whoever_holds_the_key(
    client: aioredis.Redis, redis_key_prefix: str
) -> None:
    store = RedisStore(client, key_prefix=redis_key_prefix)
    await store.try_acquire("k", pending("k", "stuck-owner"), LOCK_TTL)
    response = StoredResponse(status_code=200, headers=(), body=b"resolved by hand")

    assert await store.resolve("k", response, ttl=60)
    assert not await store.resolve("absent", response)

    stored = await store.get("k")
    assert stored is not None
    assert stored.status is RecordStatus.COMPLETED
    assert stored.response == response


@pytest.mark.parametrize("ttl", [0, -3600, 0.5, float("nan"), float("inf"), 1e15])
async def test_resolve_refuses_a_ttl_that_would_delete_the_record(
    client: aioredis.Redis, redis_key_prefix: str, ttl: float
) -> None:
    store = RedisStore(client, key_prefix=redis_key_prefix)
    await store.try_acquire("k", pending("k", "stuck-owner"), LOCK_TTL)
    with pytest.raises(ValueError, match=r"keeps a record 1 to 3\.1536e"):
        await store.resolve("k", StoredResponse(200, (), b""), ttl=ttl)
    assert await store.get("k") is not None


@STRATEGIES
async def test_a_renewal_to_a_lease_of_0_ends_it_now_and_keeps_the_ttl(
    client: aioredis.Redis, redis_key_prefix: str, acquire: AcquireStrategy
) -> None:
    """How ``delete`` and ``resolve`` give back a record they took over that changed hands:
    a retry recovers it at once, its TTL as it was. A bare lock is kept a millisecond (its
    TTL, which ``PEXPIRE 0`` would end by deleting it), as before."""
    store = RedisStore(client, key_prefix=redis_key_prefix, acquire=acquire)
    held = pending("k", "owner-a")
    assert (await store.try_acquire("k", held, LOCK_TTL)).acquired
    saved = replace(held, checkpoints=(Checkpoint("sent", [], time.time()),))
    assert await store.save_progress("k", saved, RETENTION_TTL, LOCK_TTL)

    assert await store.renew("k", "owner-a", 0)

    assert LOCK_TTL * 1000 < await client.pttl(f"{redis_key_prefix}:k") <= RETENTION_TTL * 1000
    assert (await store.try_acquire("k", pending("k", "owner-b"), LOCK_TTL)).acquired
    bare = pending("bare", "owner-a")
    assert (await store.try_acquire("bare", bare, LOCK_TTL)).acquired
    assert await store.renew("bare", "owner-a", 0)
    assert await client.pttl(f"{redis_key_prefix}:bare") <= 1
