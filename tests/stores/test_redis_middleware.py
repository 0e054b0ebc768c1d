"""The middleware over a real Redis: outages, a frozen server, and duplicates waiting across
two app instances ("pods") that share one Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, RedisStore, idempotent
from starlette_idempotency.stores.redis import DriverName
from starlette_idempotency.stores.redis._redis_py import RedisPyDriver
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.conditions import eventually
from tests.support.guarded import make_client
from tests.support.stores import DRIVERS, answers

pytestmark = pytest.mark.redis

HEADERS = {"Idempotency-Key": "k"}


class Pod:
    """One app instance with its own RedisStore (its own connections)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        runs: list[str],
        name: str,
        *,
        store_timeout: float = 0.3,
        driver: DriverName = "redis-py",
        **options: Any,
    ) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()

        @idempotent(**options)
        async def pay(request: Request) -> Response:
            runs.append(name)
            self.entered.set()
            await self.gate.wait()
            return JSONResponse({"pod": name, "n": len(runs)}, status_code=201)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        self.store = RedisStore.from_url(url, key_prefix=prefix, acquire="lua", driver=driver)
        self.middleware = IdempotencyMiddleware(
            app, store=self.store, store_timeout_seconds=store_timeout
        )
        self.client = make_client(self.middleware)

    async def post(self, key: str = "k") -> Any:
        return await self.client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": key})


@pytest.fixture(params=["redis-py", "glide"])
async def outage_pod(
    private_redis: RedisServer, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Pod, Pod, list[str]]]:
    runs: list[str] = []
    driver: DriverName = request.param
    closed = Pod(private_redis.url, "t", runs, "closed", driver=driver, lock_ttl_seconds=1)
    opened = Pod(private_redis.url, "t", runs, "open", driver=driver, on_store_error="fail_open")
    yield closed, opened, runs
    private_redis.thaw()
    for pod in (closed, opened):
        await pod.store.aclose()


async def test_stopped_redis_fails_closed_or_open_and_recovers(
    outage_pod: tuple[Pod, Pod, list[str]], private_redis: RedisServer
) -> None:
    closed, opened, runs = outage_pod
    assert (await closed.post("before")).status_code == 201
    private_redis.stop()
    down = await closed.post("during")
    assert down.status_code == 503
    assert down.headers["retry-after"] == "1"
    assert (await opened.post("during-open")).status_code == 201  # ran unprotected
    assert runs == ["closed", "open"]
    private_redis.start()
    # the same app, no restart: the client reconnects (glide in the background, with backoff)
    await eventually(lambda: answers(closed.store), timeout=10, message="the store to reconnect")
    # glide may still send the abandoned acquire after the reconnect: a lock of at most
    # lock_ttl_seconds (1 s here), which the store also releases.
    assert (await retry_while_in_progress(closed, "during")).status_code == 201
    assert (await closed.post("during")).headers["x-idempotent-replay"] == "true"
    assert runs == ["closed", "open", "closed"]


async def test_frozen_redis_answers_503_within_the_timeout_and_recovers(
    outage_pod: tuple[Pod, Pod, list[str]], private_redis: RedisServer
) -> None:
    closed, _, runs = outage_pod
    assert (await closed.post("warm")).status_code == 201
    private_redis.freeze()
    loop = asyncio.get_running_loop()
    started = loop.time()
    frozen = await closed.post("frozen")
    assert frozen.status_code == 503
    assert loop.time() - started < 2.0
    private_redis.thaw()
    assert (await closed.post("after")).status_code == 201
    # The acquire sent into the frozen server may still run once it resumes; it can only ever
    # be a lock of lock_ttl_seconds (1 s here): the same key works again, once.
    response = await retry_while_in_progress(closed, "frozen")
    assert response.status_code == 201
    assert runs.count("closed") == 3


async def test_client_pause_leaves_no_stale_lock(
    outage_pod: tuple[Pod, Pod, list[str]], private_redis: RedisServer
) -> None:
    closed, _, _ = outage_pod
    assert (await closed.post("warm")).status_code == 201
    private_redis.command("CLIENT", "PAUSE", "3000", "WRITE")
    paused = await closed.post("paused")
    assert paused.status_code == 503
    redis_py = isinstance(closed.store._driver, RedisPyDriver)
    if redis_py:
        # the cancelled call's connection was closed: Redis drops the command it held
        await eventually(
            lambda: b"cmd=evalsha" not in private_redis.command("CLIENT", "LIST"),
            message="the timed-out connection to close",
        )
    private_redis.command("CLIENT", "UNPAUSE")
    if not redis_py:
        # glide keeps its one connection: the held acquire runs at UNPAUSE, then the fenced
        # release (an EVAL) the store queued behind it on that connection.
        await eventually(
            lambda: b"cmdstat_eval:" in private_redis.command("INFO", "commandstats"),
            message="the store's release of the abandoned acquire to run",
        )
    retry = await closed.post("paused")
    assert retry.status_code == 201, "a stale lock of the timed-out acquire answered"
    assert "x-idempotent-replay" not in retry.headers


@DRIVERS
async def test_duplicate_on_another_pod_waits_for_the_first(
    redis_url: str, redis_key_prefix: str, driver: DriverName
) -> None:
    runs: list[str] = []
    pod_a = Pod(redis_url, redis_key_prefix, runs, "a", driver=driver, on_in_progress="wait")
    pod_b = Pod(redis_url, redis_key_prefix, runs, "b", driver=driver, on_in_progress="wait")
    try:
        pod_a.gate.clear()
        first = asyncio.create_task(pod_a.post())
        async with asyncio.timeout(5):
            await pod_a.entered.wait()
        duplicate = asyncio.create_task(pod_b.post())
        await eventually(lambda: pod_b.middleware.waiters.count == 1)
        pod_a.gate.set()
        assert (await first).json() == {"pod": "a", "n": 1}
        replay = await duplicate
        assert replay.json() == {"pod": "a", "n": 1}
        assert replay.headers["x-idempotent-replay"] == "true"
        assert runs == ["a"]
    finally:
        for pod in (pod_a, pod_b):
            await pod.store.aclose()


async def test_a_thousand_waiters_cost_the_store_a_few_commands_a_second(
    private_redis: RedisServer,
) -> None:
    runs: list[str] = []
    options: dict[str, Any] = {
        "on_in_progress": "wait",
        "wait_timeout_seconds": 30,
        "store_timeout": 10.0,  # a thousand acquires at once queue up in the client
    }
    pod_a = Pod(private_redis.url, "w", runs, "a", **options)
    pod_b = Pod(private_redis.url, "w", runs, "b", **options)
    try:
        pod_a.gate.clear()
        first = asyncio.create_task(pod_a.post())
        async with asyncio.timeout(5):
            await pod_a.entered.wait()
        waiters = [asyncio.create_task(pod_b.post()) for _ in range(1000)]
        await eventually(lambda: pod_b.middleware.waiters.count == 1000, timeout=30)
        before = _commands(private_redis)
        await asyncio.sleep(3.0)  # the quiet period being measured
        during = _commands(private_redis) - before
        pod_a.gate.set()
        await first
        responses = await asyncio.gather(*waiters)
        assert {r.status_code for r in responses} == {201}
        assert runs == ["a"]
        assert during <= 15, f"{during} commands in 3 s while 1000 duplicates waited"
    finally:
        for pod in (pod_a, pod_b):
            await pod.store.aclose()


async def retry_while_in_progress(pod: Pod, key: str) -> Any:
    """POST as a client would while a stale lock may still hold the key (409), for 10 s."""

    async def settled() -> Any:
        response = await pod.post(key)
        return None if response.status_code == 409 else response

    return await eventually(settled, timeout=10, interval=0.1, message=f"{key!r} to be free")


def _commands(server: RedisServer) -> int:
    info = server.command("INFO", "stats").decode()
    processed = next(line for line in info.splitlines() if line.startswith("total_commands"))
    # minus the INFO command itself, which this helper sends
    return int(processed.split(":")[1]) - 1


@pytest.mark.parametrize("finish", ["complete", "release"])
@DRIVERS
async def test_wait_for_change_returns_on_another_processs_notice(
    redis_url: str, redis_key_prefix: str, finish: str, driver: DriverName
) -> None:
    from starlette_idempotency._record import RecordStatus, StoredResponse
    from tests.support.records import pending

    waiting_store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix, driver=driver)
    other_store = RedisStore.from_url(redis_url, key_prefix=redis_key_prefix)
    try:
        record = pending("k", "owner")
        assert (await other_store.try_acquire("k", record, 30)).acquired
        waiter = asyncio.create_task(waiting_store.wait_for_change("k"))
        channel = waiting_store.storage_key("k")
        probe = aioredis.from_url(redis_url)

        async def subscribed() -> bool:
            return bool((await probe.pubsub_numsub(channel))[0][1] >= 1)

        try:
            await eventually(subscribed, message="the subscription to be live on the server")
        finally:
            await probe.aclose()
        assert not waiter.done()  # nothing happened to the key yet: no return
        if finish == "complete":
            done = record.finished(RecordStatus.COMPLETED, StoredResponse(200, (), b"{}"), 1e10)
            assert await other_store.finish("k", done, 60)
        else:
            assert await other_store.release("k", "owner")
        async with asyncio.timeout(5):
            await waiter  # only a notice can end this wait: it has no poll of its own
    finally:
        await waiting_store.aclose()
        await other_store.aclose()
