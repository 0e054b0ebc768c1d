"""Redis misbehaving under a real uvicorn process: a lock evicted or deleted while its handler
runs, and a stall that outlasts the store timeout. Neither may run a handler twice or hold a
key with nobody behind it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis

from starlette_idempotency import storage_key
from starlette_idempotency.testing._redis_server import RedisServer, redis_command
from tests.support.conditions import eventually
from tests.support.uvicorn import UvicornServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

LOCK_KEY = "e2e:" + storage_key("t", "POST", "/slow", "k")


@pytest.fixture
def evicting_redis() -> Iterator[RedisServer]:
    args = ["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(extra_args=args) as server:
        yield server


async def serve(redis_url: str, lock_ttl: float) -> UvicornServer:
    env = {"IDEM_TEST_REDIS_URL": redis_url, "IDEM_TEST_LOCK_TTL": str(lock_ttl)}
    return UvicornServer("tests.e2e.apps.redis_guarded:create_app", env=env, factory=True)


@pytest.fixture
async def app_on(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RedisServer, httpx.AsyncClient]]:
    server: RedisServer = request.getfixturevalue(request.param)
    lock_ttl = 1.5 if request.param == "evicting_redis" else 30.0
    with await serve(server.url, lock_ttl) as app:
        async with httpx.AsyncClient(base_url=app.url, timeout=10) as client:
            yield server, client


def evict(client: redis.Redis) -> None:
    """Fill the server past maxmemory until the lock is evicted."""
    filler = b"x" * 64 * 1024
    for n in range(10_000):
        if not client.exists(LOCK_KEY):
            return
        client.set(f"filler:{n}", filler)
    raise AssertionError("the lock was never evicted")


@pytest.mark.parametrize("app_on", ["evicting_redis"], indirect=True)
@pytest.mark.parametrize("vanish", ["evicted", "deleted"])
async def test_a_vanished_lock_is_taken_back_before_a_retry_can_run(
    app_on: tuple[RedisServer, httpx.AsyncClient], vanish: str
) -> None:
    server, client = app_on
    admin = redis.Redis.from_url(server.url)
    first = asyncio.create_task(
        client.post("/slow?wait=1", json={}, headers={"Idempotency-Key": "k"})
    )
    await eventually(lambda: bool(admin.exists(LOCK_KEY)), message="the lock in Redis")
    if vanish == "evicted":
        evict(admin)
    else:
        admin.delete(LOCK_KEY)
    await eventually(lambda: bool(admin.exists(LOCK_KEY)), message="the owner taking its lock back")
    retry = await client.post("/slow?wait=1", json={}, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 409
    await client.post("/release")
    assert (await first).status_code == 200
    state = (await client.get("/state")).json()
    assert state["executions"] == 1
    assert "reclaimed" in state["lock_lost"]


@pytest.fixture
def stalling_redis() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--enable-debug-command", "yes"]) as server:  # DEBUG SLEEP
        yield server


def is_stalled(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_timeout=0.1).ping()
    except redis.TimeoutError:
        return True
    return False


@pytest.mark.parametrize("app_on", ["stalling_redis"], indirect=True)
@pytest.mark.parametrize("stall", [("DEBUG", "SLEEP", "2"), ("CLIENT", "PAUSE", "2000", "WRITE")])
async def test_an_acquire_abandoned_in_a_stall_does_not_hold_the_key(
    app_on: tuple[RedisServer, httpx.AsyncClient], stall: tuple[str, ...]
) -> None:
    server, client = app_on
    await client.get("/state")
    # DEBUG SLEEP blocks its caller for the whole stall; CLIENT PAUSE answers at once.
    # The reply comes when the stall ends: wait for it well past the 2 s it lasts.
    stalling = threading.Thread(
        target=redis_command, args=(server.port, *stall), kwargs={"timeout": 10}
    )
    stalling.start()
    try:
        await eventually(
            lambda: stall[0] == "CLIENT" or is_stalled(server.url), message="Redis to stall"
        )
        if stall[0] == "CLIENT":
            await asyncio.to_thread(stalling.join)
        during = await client.post("/slow", json={}, headers={"Idempotency-Key": "k"})
        assert during.status_code == 503  # cut off by store_timeout_seconds
    finally:
        await asyncio.to_thread(stalling.join)
    # Redis ran the buffered acquire when it woke; the key must not answer 409 for the lock's
    # 30 s with no handler behind it.
    answers: list[int] = []

    async def answered() -> bool:
        retry = await client.post("/slow", json={}, headers={"Idempotency-Key": "k"})
        answers.append(retry.status_code)
        return retry.status_code not in (409, 503)

    await eventually(answered, timeout=10, message="the key to be free again")
    assert answers[-1] == 200, answers
    assert (await client.get("/state")).json()["executions"] == 1
