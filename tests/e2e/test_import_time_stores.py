"""``uvicorn main:app`` with the store built at import time, under uvicorn's default lifespan
mode (``auto``), in real uvicorn processes (the apps: :mod:`tests.e2e.apps.import_time_stores`).

Requests are guarded; the connections are opened in the server's event loop (by the startup
check, before any request: no "attached to a different loop"); when the server stops, the
middleware closes what the store opened before the process exits (the app prints what is left
once its shutdown has run), and a pool the app handed over stays the app's until its own
shutdown is done with it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.testing._isolation import delete_prefixed_at, unique_prefix
from starlette_idempotency.testing._processes import free_port
from tests.stores.test_store_lifespan import postgres_connections, redis_connections
from tests.support.conditions import eventually_sync
from tests.support.uvicorn import REPO_ROOT

pytestmark = pytest.mark.e2e

APP = "tests.e2e.apps.import_time_stores:app"


@contextmanager
def served(env: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
    """``python -m uvicorn APP`` with uvicorn's defaults (the lifespan's ``auto`` mode), until
    its startup completes; yields its URL and what it logs (all of it once the block ends).
    The block's end stops it with SIGTERM, as an orchestrator does, and waits for it to exit."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", APP, "--port", str(port), "--no-access-log"],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    logged: list[str] = []
    stderr = process.stderr
    assert stderr is not None
    reader = threading.Thread(target=lambda: logged.extend(iter(stderr.readline, "")))
    reader.start()
    try:
        eventually_sync(
            lambda: process.poll() is not None or "Uvicorn running on" in "".join(logged),
            timeout=30,
            message="uvicorn to start",
        )
        assert process.poll() is None, "the server exited:\n" + "".join(logged)
        yield f"http://127.0.0.1:{port}", logged
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        reader.join(timeout=10)
        stderr.close()
    output = "".join(logged)
    # uvicorn raises the signal it caught again once it has shut down
    assert process.returncode in (0, -signal.SIGTERM), (process.returncode, output)
    assert "Application shutdown complete" in output, output


def assert_clean(output: str) -> None:
    for trouble in ("attached to a different loop", "Traceback", "ERROR", "unclosed"):
        assert trouble not in output, output
    assert "connections at shutdown: 0" in output, output


async def pay_twice(url: str) -> None:
    """One request and its retry: the handler runs once, the retry gets the stored answer."""
    key = str(uuid.uuid4())
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        first = await client.post("/payments", headers={"Idempotency-Key": key})
        retry = await client.post("/payments", headers={"Idempotency-Key": key})
        unkeyed = await client.post("/payments")
    assert first.status_code == 200, first.text
    assert retry.json() == first.json()
    assert retry.headers["x-idempotent-replay"] == "true"
    assert unkeyed.status_code == 400  # guarded: the key is required


@pytest.fixture
def name() -> str:
    return f"import-time-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def table(postgres_dsn: str, postgres_table: str) -> str:
    """The test's table, made before the app starts, as a migration makes it."""

    async def migrate() -> None:
        async with PostgresStore.from_dsn(postgres_dsn, table=postgres_table) as store:
            await store.create_schema()

    asyncio.run(migrate())
    return postgres_table


@pytest.mark.postgres
def test_from_dsn_under_uvicorn_main_app(postgres_dsn: str, table: str, name: str) -> None:
    env = {"IDEM_TEST_SETUP": "from_dsn", "IDEM_TEST_DSN": postgres_dsn, "IDEM_TEST_TABLE": table}
    with served({**env, "IDEM_TEST_NAME": name}) as (url, logged):
        # the startup check opened the pool, in the server's loop, before any request
        assert postgres_connections(postgres_dsn, name) == 1
        asyncio.run(pay_twice(url))
    assert_clean("".join(logged))
    assert postgres_connections(postgres_dsn, name) == 0


@pytest.mark.postgres
def test_a_pool_opened_in_the_lifespan_and_handed_over(
    postgres_dsn: str, table: str, name: str
) -> None:
    env = {"IDEM_TEST_SETUP": "use_pool", "IDEM_TEST_DSN": postgres_dsn, "IDEM_TEST_TABLE": table}
    with served({**env, "IDEM_TEST_NAME": name}) as (url, logged):
        asyncio.run(pay_twice(url))
    output = "".join(logged)
    assert_clean(output)  # the app's shutdown used its pool after the middleware's part
    assert postgres_connections(postgres_dsn, name) == 0


@pytest.mark.redis
@pytest.mark.parametrize("driver", ["redis-py", "glide"])
def test_redis_from_url_under_uvicorn_main_app(redis_url: str, name: str, driver: str) -> None:
    prefix = unique_prefix()
    env = {
        "IDEM_TEST_SETUP": "redis",
        "IDEM_TEST_REDIS_URL": redis_url,
        "IDEM_TEST_PREFIX": prefix,
        "IDEM_TEST_DRIVER": driver,
        "IDEM_TEST_NAME": name,
    }
    try:
        with served(env) as (url, logged):
            assert redis_connections(redis_url, name) >= 1  # connected by the startup check
            asyncio.run(pay_twice(url))
        assert_clean("".join(logged))
        assert redis_connections(redis_url, name) == 0
    finally:
        asyncio.run(delete_prefixed_at(redis_url, prefix))
