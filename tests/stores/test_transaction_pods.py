"""The effects stay once when the lease does not: two uvicorn pods of
:mod:`tests.stores.transaction_app` on one PostgreSQL, whose handler calls a provider with a
derived key and commits the payment row with its idempotency record in one transaction, on
asyncpg and on SQLAlchemy.

A pod killed (SIGKILL) right after the commit, a first attempt that sleeps past its lock before
its transaction (at each isolation level), a loop blocked past the lock: each time the retry on
the other pod is answered with the one committed outcome, the table holds one payment, and the
provider charged once per derived key.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.stores.transaction_app import ISOLATIONS, LOCK_TTL_SECONDS
from tests.support.conditions import eventually
from tests.support.uvicorn import UvicornServer

pytestmark = pytest.mark.postgres

DRIVERS = ("asyncpg", "sqlalchemy")
APP = "tests.stores.transaction_app:create_app"


@pytest.fixture(params=DRIVERS)
def pods(request: pytest.FixtureRequest, postgres_dsn: str, tables: str) -> Iterator[list[str]]:
    """Two pods of the payments app on the test database, their URLs."""
    env = {"IDEM_TEST_DSN": postgres_dsn, "IDEM_TEST_TABLE": tables}
    env["IDEM_TEST_DRIVER"] = request.param
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                UvicornServer(APP, env={**env, "IDEM_TEST_POD": name}, factory=True)
            ).url
            for name in ("a", "b")
        ]


async def post(url: str, key: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(
            "/pay", json={"amount": "9.99"}, headers={"Idempotency-Key": key, **headers}
        )


async def effects(sql: Any, table: str, key: str) -> tuple[list[str], list[int]]:
    """The pods that wrote a payment for ``key``, and the provider's call counts."""
    paid = await sql.fetch(f"SELECT pod FROM {table}_payments WHERE idempotency_key = $1", key)
    provider = await sql.fetch(f"SELECT calls FROM {table}_provider")
    return [row["pod"] for row in paid], [row["calls"] for row in provider]


async def lock_lapsed(sql: Any, table: str, key: str) -> None:
    """Until the key's lock has lapsed on the database's clock (the lock's age is what the
    retry depends on)."""
    query = f"SELECT expires_at <= now() FROM {table} WHERE idempotency_key = $1"
    await eventually(lambda: sql.fetchval(query, key), timeout=10, message="the lock to lapse")


async def test_a_pod_killed_after_its_commit_leaves_a_replay(
    pods: list[str], sql: Any, tables: str
) -> None:
    key = f"kill-{uuid.uuid4().hex[:8]}"
    with pytest.raises(httpx.TransportError):  # the pod died before its response went out
        await post(pods[0], key, **{"X-Die-After-Commit": "1"})
    retry = await post(pods[1], key)
    assert retry.status_code == 201, retry.text
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.json()["pod"] == "a"
    assert await effects(sql, tables, key) == (["a"], [1])


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_a_first_attempt_that_outsleeps_its_lock_commits_nothing(
    pods: list[str], sql: Any, tables: str, isolation: str
) -> None:
    """Its lock is not renewed (``/pay-unrenewed``): the retry on the other pod takes the key
    over and commits; the first attempt's transaction then refuses, and its client gets the
    retry's answer."""
    key = f"sleep-{uuid.uuid4().hex[:8]}"

    async def first() -> httpx.Response:
        async with httpx.AsyncClient(base_url=pods[0], timeout=30) as client:
            return await client.post(
                "/pay-unrenewed",
                json={"amount": "9.99"},
                headers={
                    "Idempotency-Key": key,
                    "X-Isolation": isolation,
                    "X-Sleep-Seconds": str(LOCK_TTL_SECONDS * 1.5),
                },
            )

    sleeping = asyncio.create_task(first())
    await lock_lapsed(sql, tables, key)
    async with httpx.AsyncClient(base_url=pods[1], timeout=30) as client:
        retry = await client.post(
            "/pay-unrenewed",
            json={"amount": "9.99"},
            headers={"Idempotency-Key": key, "X-Isolation": isolation},
        )
    assert retry.status_code == 201, retry.text
    answered = await sleeping
    assert answered.status_code == 201, answered.text
    assert answered.json() == retry.json()
    assert answered.headers["x-idempotent-replay"] == "true"
    # One payment, by the retry; the provider got two calls with one derived key, one charge.
    assert await effects(sql, tables, key) == (["b"], [2])


async def test_a_loop_blocked_past_its_lock_charges_and_pays_once(
    pods: list[str], sql: Any, tables: str
) -> None:
    """Nothing renews a lock while its loop is blocked: the retry takes the key over. The
    derived key makes the provider's second call a repeat, and the transaction keeps the
    blocked attempt's payment out."""
    key = f"block-{uuid.uuid4().hex[:8]}"
    blocked = asyncio.create_task(
        post(pods[0], key, **{"X-Block-Seconds": str(LOCK_TTL_SECONDS * 2)})
    )
    started = time.monotonic()
    await lock_lapsed(sql, tables, key)
    retry = await post(pods[1], key)
    assert time.monotonic() - started < LOCK_TTL_SECONDS * 2, "the first attempt is still blocked"
    assert retry.status_code == 201, retry.text
    answered = await blocked
    assert answered.json() == retry.json()
    assert await effects(sql, tables, key) == (["b"], [2])
