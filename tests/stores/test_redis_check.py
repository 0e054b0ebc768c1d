"""RedisStore.describe and check: what a startup check reports about real servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
import redis.asyncio as aioredis

from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores.base import CheckableStore, StoreFinding
from starlette_idempotency.stores.redis import DriverName, RedisStore
from starlette_idempotency.stores.redis import _check as redis_check
from starlette_idempotency.testing._redis_server import RedisClusterServers, RedisServer
from tests.support.records import finished, pending
from tests.support.stores import DRIVERS, glide_client

pytestmark = pytest.mark.redis


@pytest.fixture
def server_args() -> Sequence[str]:
    """The test's own redis-server arguments (after persistence off: they override it)."""
    return ()


@pytest.fixture
def server(server_args: Sequence[str]) -> Iterator[RedisServer]:
    with RedisServer(extra_args=server_args) as started:
        yield started


@pytest.fixture
async def store(server: RedisServer, driver: DriverName) -> AsyncIterator[RedisStore]:
    made = RedisStore.from_url(server.url, driver=driver)
    yield made
    await made.aclose()


def warnings(findings: list[StoreFinding], about: str) -> list[str]:
    assert all(finding.level == "warning" for finding in findings), findings
    return [finding.message for finding in findings if about in finding.message]


@DRIVERS
async def test_describe_names_the_address_without_credentials(
    server: RedisServer, driver: DriverName
) -> None:
    store = RedisStore.from_url(f"redis://app:s3cret@127.0.0.1:{server.port}/0", driver=driver)
    try:
        assert isinstance(store, CheckableStore)
        assert store.describe() == f"redis at 127.0.0.1:{server.port}/0"
    finally:
        await store.aclose()


async def test_describe_a_client_passed_in(server: RedisServer) -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{server.port}/3")
    glide = await glide_client(server.url)
    try:
        assert RedisStore(client).describe() == f"redis at 127.0.0.1:{server.port}/3"
        assert RedisStore(glide).describe() == f"redis at 127.0.0.1:{server.port}/0"
    finally:
        await client.aclose()
        await glide.close()


@pytest.mark.parametrize(
    "server_args", [["--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"]]
)
@DRIVERS
async def test_an_evicting_policy_is_a_warning(store: RedisStore) -> None:
    findings = await store.check()

    (eviction,) = warnings(findings, "can evict")
    assert "maxmemory 10485760 bytes with maxmemory-policy allkeys-lru" in eviction
    assert "maxmemory-policy noeviction" in eviction
    assert "an instance of its own with noeviction" in eviction


@pytest.mark.parametrize(
    "server_args", [["--maxmemory", "10mb", "--maxmemory-policy", "volatile-ttl"]]
)
@DRIVERS
async def test_a_volatile_policy_is_a_warning_too(store: RedisStore) -> None:
    (eviction,) = warnings(await store.check(), "can evict")

    assert "volatile-* policies evict them too" in eviction


@pytest.mark.parametrize(
    "server_args",
    [["--maxmemory", "10mb", "--maxmemory-policy", "noeviction", "--appendonly", "yes"]],
)
@DRIVERS
async def test_noeviction_with_an_append_only_file_finds_nothing(store: RedisStore) -> None:
    assert await store.check() == []


@DRIVERS
async def test_no_persistence_at_all_is_a_warning(store: RedisStore) -> None:
    (persistence,) = warnings(await store.check(), "append-only")

    assert "a restart loses every record" in persistence
    assert "appendonly yes" in persistence
    assert "appendfsync everysec" in persistence


@pytest.mark.parametrize("server_args", [["--save", "3600 1 300 100"]])
@DRIVERS
async def test_snapshots_only_is_a_warning(store: RedisStore) -> None:
    (persistence,) = warnings(await store.check(), "append-only")

    assert "since the last RDB snapshot (save '3600 1 300 100')" in persistence


@DRIVERS
async def test_a_stopped_server_is_one_error(server: RedisServer, store: RedisStore) -> None:
    server.stop()

    (finding,) = await store.check()

    assert finding.level == "error"
    assert finding.message.startswith(f"redis at 127.0.0.1:{server.port}/0 is unreachable")


async def test_a_hung_server_is_one_error_within_the_check_timeout(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_check, "CHECK_TIMEOUT_SECONDS", 0.3)
    store = RedisStore.from_url(server.url)
    server.freeze()
    try:
        (finding,) = await store.check()
    finally:
        server.thaw()
        await store.aclose()

    assert finding == StoreFinding(
        "error",
        f"redis at 127.0.0.1:{server.port}/0 is unreachable: no answer to PING within 0.3 s",
    )


@pytest.mark.parametrize("server_args", [["--rename-command", "CONFIG", ""]])
@DRIVERS
async def test_a_refused_config_command_is_one_warning(store: RedisStore) -> None:
    (finding,) = await store.check()

    assert finding.level == "warning"
    assert "could not read the configuration of redis at" in finding.message
    assert "unknown command 'CONFIG'" in finding.message
    assert "maxmemory-policy is noeviction (or maxmemory 0)" in finding.message
    assert "appendonly is yes" in finding.message


@pytest.mark.cluster
@DRIVERS
async def test_a_cluster_is_checked_on_every_primary(
    redis_cluster: RedisClusterServers, driver: DriverName
) -> None:
    if driver == "redis-py":
        cluster = aioredis.RedisCluster.from_url(redis_cluster.url)
        store, close = RedisStore(cluster), cluster.aclose
    else:
        glide = await glide_client(redis_cluster.url, redis_cluster.ports)
        store, close = RedisStore(glide), glide.close
    evicting = redis_cluster.nodes[1]
    evicting.command("CONFIG", "SET", "maxmemory", "100mb")
    evicting.command("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    try:
        assert store.describe().startswith("redis cluster at 127.0.0.1:")
        findings = await store.check()
    finally:
        evicting.command("CONFIG", "SET", "maxmemory", "0")
        evicting.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
        await store.aclose()
        await close()

    (eviction,) = warnings(findings, "can evict")
    assert f"(on 127.0.0.1:{evicting.port})" in eviction
    (persistence,) = warnings(findings, "append-only")
    every_node = ", ".join(sorted(f"127.0.0.1:{port}" for port in redis_cluster.ports))
    assert f"(on {every_node})" in persistence


@DRIVERS
async def test_a_user_that_cannot_run_the_scripts_is_an_error(
    server: RedisServer, driver: DriverName
) -> None:
    """Such a user acquires (SET NX) and then fails every outcome's write: each retry would
    run the handler again once the lock lapsed. Reaching Redis is not enough to be ready."""
    admin = aioredis.from_url(server.url)
    await admin.acl_setuser(
        "noscripts",
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-evalsha", "-eval"],
    )
    store = RedisStore.from_url(f"redis://noscripts:pw@127.0.0.1:{server.port}/0", driver=driver)

    async def errors() -> list[StoreFinding]:
        return [finding for finding in await store.check() if finding.level == "error"]

    try:
        [error] = await errors()
        assert len(await errors()) == 1  # refused again: not ready until it works
        await admin.acl_setuser("noscripts", commands=["+evalsha", "+eval"])
        assert await errors() == []
        # Once it has worked, a probe does not try it again while the store works...
        await admin.acl_setuser("noscripts", commands=["-evalsha", "-eval"])
        assert await errors() == []
        # ... but once a request's write failed, the store is not ready until it works.
        held = pending("k")
        assert (await store.try_acquire("k", held, 30)).acquired
        with pytest.raises(StoreError, match="finish failed"):
            await store.finish("k", finished(held), 60)
        [refused] = await errors()
        assert "refuses what every request does" in refused.message
    finally:
        await store.aclose()
        await admin.aclose()
    assert "refuses what every request does" in error.message
    assert "evalsha" in error.message.lower()
    assert "+@scripting" in error.message
    assert "on the keys and channels idempotency* (" in error.message  # the claims' too


async def test_waiting_for_missing_replicas_is_not_a_refusal(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Each write waits ``wait_timeout_ms`` for a replica that is not there, and the store
    still works: its check leaves the waits out, and answers within a probe's 2 s."""
    store = RedisStore.from_url(server.url, wait_replicas=1, wait_timeout_ms=5000)
    try:
        async with asyncio.timeout(2):
            findings = await store.check()
    finally:
        await store.aclose()
    assert [finding for finding in findings if finding.level == "error"] == []
    assert "replicas acknowledged" not in caplog.text


@DRIVERS
async def test_the_check_leaves_no_key_behind(store: RedisStore, server: RedisServer) -> None:
    await store.check()
    admin = aioredis.from_url(server.url)
    try:
        assert await admin.keys("*") == []
    finally:
        await admin.aclose()
