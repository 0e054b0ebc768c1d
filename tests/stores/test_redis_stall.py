"""An acquire abandoned while Redis stalls is undone, on both drivers.

A stall (a slow command, the fork of a snapshot, ``DEBUG SLEEP``, a frozen process) leaves the
acquire in Redis's socket buffer. The middleware's deadline cancels the call and answers 503;
redis-py closes the connection, but Redis still reads and runs the ``SET`` when it wakes, so
without an undo the key stays ``InProgress`` with no handler for the whole lock TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import redis.asyncio as aioredis

from starlette_idempotency._record import Checkpoint, IdempotencyRecord, dump_record
from starlette_idempotency.stores import IdempotencyStore
from starlette_idempotency.stores.base import take_back
from starlette_idempotency.stores.redis import AcquireStrategy, DriverName, RedisStore
from starlette_idempotency.stores.redis._driver import Arg
from starlette_idempotency.testing import FaultyStore
from starlette_idempotency.testing._redis_server import RedisServer, encode_command
from tests.support.conditions import eventually
from tests.support.records import pending
from tests.support.stores import DRIVERS, STRATEGIES, command_calls

pytestmark = pytest.mark.redis

Stall = Literal["sigstop", "debug-sleep"]

LOCK_TTL = 30.0
#: The middleware's bound on a store call, far shorter than the stall.
CALL_DEADLINE = 0.2
DEBUG_SLEEP_SECONDS = 1.5
#: glide resends within its request_timeout; short here so the second release comes soon.
GLIDE_OPTIONS = {"request_timeout": 500}


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private Redis that accepts ``DEBUG SLEEP`` from local clients."""
    with RedisServer(extra_args=["--enable-debug-command", "local"]) as started:
        yield started


def sleeping(server: RedisServer) -> bool:
    """Whether the server's main thread is inside ``DEBUG SLEEP`` (not in its event loop)."""
    return "nanosleep" in Path(f"/proc/{server.pid}/wchan").read_text()


@contextlib.asynccontextmanager
async def stalled(server: RedisServer, how: Stall) -> AsyncIterator[None]:
    """Redis reads nothing inside the block; on leaving it, Redis runs again (after the sleep
    has run out, for ``debug-sleep``), while this event loop keeps serving other tasks."""
    if how == "sigstop":
        server.freeze()
        try:
            yield
        finally:
            server.thaw()
        return
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(encode_command("DEBUG", "SLEEP", str(DEBUG_SLEEP_SECONDS)))
        await eventually(lambda: sleeping(server), message="redis-server to enter DEBUG SLEEP")
        yield
        async with asyncio.timeout(DEBUG_SLEEP_SECONDS + 5):
            assert await reader.readline() == b"+OK\r\n"
    finally:
        writer.close()
        await writer.wait_closed()


async def calls(admin: aioredis.Redis, command: str) -> int:
    return (await command_calls(admin)).get(command, 0)


@pytest.mark.parametrize(("stall", "rounds"), [("sigstop", 10), ("debug-sleep", 2)])
@STRATEGIES
@DRIVERS
async def test_an_acquire_abandoned_while_redis_stalls_is_undone(
    server: RedisServer,
    driver: DriverName,
    acquire: AcquireStrategy,
    stall: Stall,
    rounds: int,
) -> None:
    options: dict[str, Any] = GLIDE_OPTIONS if driver == "glide" else {}
    store = RedisStore.from_url(
        server.url, key_prefix="p", acquire=acquire, driver=driver, **options
    )
    admin = aioredis.from_url(server.url)
    try:
        warm = pending("warm", "w")
        await store.try_acquire("warm", warm, LOCK_TTL)  # scripts loaded
        await store.release("warm", "w")
        # Idle open connections in redis-py's pool, so an undo goes out during the stall.
        await asyncio.gather(*(store.get(f"warm{n}") for n in range(3)))
        for n in range(rounds):
            key = f"k{n}"
            sets, evals = await calls(admin, "set"), await calls(admin, "eval")
            async with stalled(server, stall):
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(CALL_DEADLINE):  # as the middleware bounds calls
                        await store.try_acquire(key, pending(key, "owner-a"), LOCK_TTL)

            async def undone(key: str = key, sets: int = sets, evals: int = evals) -> bool:
                # The held acquire ran after the stall, both releases ran, the key is free.
                return (
                    await calls(admin, "set") > sets
                    and await calls(admin, "eval") >= evals + 2
                    and await admin.get(f"p:{key}") is None
                )

            await eventually(
                undone, message=f"round {n}: the abandoned acquire to run and be undone"
            )
            assert (await store.try_acquire(key, pending(key, "owner-b"), LOCK_TTL)).acquired
    finally:
        await store.aclose()
        await admin.aclose()


def dead_handlers_record(key: str) -> IdempotencyRecord:
    """An ``InProgress`` record with a recovery point whose lease ran out a second ago."""
    now = time.time()
    point = Checkpoint("provider_charge_sent", {"providerRef": "ch_1"}, now)
    return replace(pending(key, "owner-a"), checkpoints=(point,), locked_until=now - 1)


@DRIVERS
async def test_a_takeover_abandoned_while_redis_stalls_ends_its_lease(
    server: RedisServer, driver: DriverName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Undoing an abandoned takeover ends the lease it took, keeping the dead handler's recovery
    points, so the next retry takes it over at once (a release would delete the checkpoints)."""
    options: dict[str, Any] = GLIDE_OPTIONS if driver == "glide" else {}
    store = RedisStore.from_url(server.url, key_prefix="p", driver=driver, **options)
    admin = aioredis.from_url(server.url)
    recover = store._driver.scripts["recover"]

    def stalling_before_takeover(keys: list[str], args: list[Arg]) -> Awaitable[Any]:
        server.freeze()  # the acquire's reply came back; Redis stalls before the takeover
        return recover(keys, args)

    try:
        await admin.set("p:warm", dump_record(dead_handlers_record("warm")), px=60_000)
        assert (await store.try_acquire("warm", pending("warm", "w"), LOCK_TTL)).acquired
        await asyncio.gather(*(store.get(f"warm{n}") for n in range(3)))
        for n in range(10):
            key = f"k{n}"
            record = dead_handlers_record(key)
            dead = dump_record(record)
            await admin.set(f"p:{key}", dead, px=60_000)
            evals = await calls(admin, "eval")
            monkeypatch.setitem(store._driver.scripts, "recover", stalling_before_takeover)
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(CALL_DEADLINE):
                        await store.try_acquire(key, pending(key, "owner-b"), LOCK_TTL)
            finally:
                server.thaw()
                monkeypatch.undo()

            async def undone(key: str = key, evals: int = evals) -> bool:
                return await calls(admin, "eval") >= evals + 2

            await eventually(undone, message=f"round {n}: the takeover to be undone")
            retry = await store.try_acquire(key, pending(key, "owner-c"), LOCK_TTL)
            assert retry.acquired
            assert retry.record is not None
            assert retry.record.owner_token == "owner-b"  # the abandoned takeover, its lease over
            as_taken = replace(retry.record, owner_token="owner-a", locked_until=None)
            assert dump_record(as_taken) == dump_record(replace(record, locked_until=None))
    finally:
        await store.aclose()
        await admin.aclose()


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "wrapped"])
@DRIVERS
async def test_a_take_back_cut_short_while_redis_stalls_is_not_undone(
    server: RedisServer, driver: DriverName, wrapped: bool
) -> None:
    """A handler whose lock vanished takes its key back with its own owner token; when that
    write times out in a stall it may still land, and it must stay: undone (fenced by the same
    token), it would free the key of a handler that still runs, for a retry to run it again.
    Wrapped in another store (``FaultyStore``), which passes the take-back on unknowing."""
    options: dict[str, Any] = GLIDE_OPTIONS if driver == "glide" else {}
    store = RedisStore.from_url(server.url, key_prefix="p", driver=driver, **options)
    taking: IdempotencyStore = FaultyStore(store) if wrapped else store
    admin = aioredis.from_url(server.url)
    try:
        warm = pending("warm", "w")
        await store.try_acquire("warm", warm, LOCK_TTL)  # scripts loaded
        await asyncio.gather(*(store.get(f"warm{n}") for n in range(3)))
        for n in range(5):
            key = f"k{n}"
            running = pending(key, "handler")
            assert (await store.try_acquire(key, running, LOCK_TTL)).acquired
            await admin.delete(f"p:{key}")  # evicted while the handler runs
            evals = await calls(admin, "eval")
            with stalled_for(server):
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(CALL_DEADLINE):
                        await take_back(taking, key, running, LOCK_TTL)
                assert not store._undoing, "an undo was made for a take-back"

            async def back(key: str = key) -> bool:
                held = await store.get(key)
                return held is not None and held.owner_token == "handler"

            await eventually(back, message=f"round {n}: the take-back to land after the stall")
            retry = await store.try_acquire(key, pending(key, "retry"), LOCK_TTL)
            assert not retry.acquired
            assert await calls(admin, "eval") == evals  # no abandon.lua ran
    finally:
        await store.aclose()
        await admin.aclose()


@contextlib.contextmanager
def stalled_for(server: RedisServer) -> Iterator[None]:
    server.freeze()
    try:
        yield
    finally:
        server.thaw()
