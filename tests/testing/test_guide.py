"""Tests of the payments API in guide_app.py: the example of docs/how-to/testing.md."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from starlette_idempotency import IdempotencyStore, MemoryStore
from starlette_idempotency.testing import Executions, FakeClock, FaultyStore
from tests.testing.guide_app import Charge, create_app

PAYMENT = {"amount": 1000}


def fake_provider(executions: Executions) -> Charge:
    """A payment provider that records each charge instead of making it."""

    async def charge(key: str, amount: int) -> str:
        executions.record(key)
        return f"ch_{key}_{executions.count(key)}"

    return charge


def client_for(store: IdempotencyStore, charge: Charge, **options: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(store, charge, **options))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.fixture
def executions() -> Executions:
    return Executions()


@pytest.fixture(params=["redis_store", "postgres_store"])
def store(request: pytest.FixtureRequest) -> FaultyStore:
    """Each real store (from the plugin's fixtures), wrapped to fail or stall on demand."""
    return FaultyStore(request.getfixturevalue(request.param))


@pytest_asyncio.fixture
async def client(store: FaultyStore, executions: Executions) -> AsyncIterator[httpx.AsyncClient]:
    # A stalled store turns into a 503 after store_timeout_seconds (1 s by default). Keep it
    # well above a first connection to a busy server, or a slow connect is a 503 too.
    async with client_for(store, fake_provider(executions)) as client:
        yield client


@pytest.mark.asyncio
async def test_a_retry_gets_the_first_answer(
    client: httpx.AsyncClient, executions: Executions
) -> None:
    headers = {"Idempotency-Key": "order-1"}
    first = await client.post("/payments", json=PAYMENT, headers=headers)
    retry = await client.post("/payments", json=PAYMENT, headers=headers)
    assert first.status_code == retry.status_code == 201
    assert retry.json() == first.json() == {"charge": "ch_order-1_1"}
    assert retry.headers["x-idempotent-replay"] == "true"
    executions.assert_ran_once("order-1")


@pytest.mark.asyncio
async def test_concurrent_duplicates_charge_once(
    client: httpx.AsyncClient, executions: Executions
) -> None:
    headers = {"Idempotency-Key": "order-2"}
    requests = [client.post("/payments", json=PAYMENT, headers=headers) for _ in range(10)]
    responses = await asyncio.gather(*requests)
    assert {response.status_code for response in responses} <= {201, 409}
    executions.assert_ran_once("order-2")


@pytest.mark.asyncio
async def test_a_store_outage_answers_503_and_charges_nothing(
    client: httpx.AsyncClient, store: FaultyStore, executions: Executions
) -> None:
    headers = {"Idempotency-Key": "order-3"}
    store.fail_next("try_acquire")
    down = await client.post("/payments", json=PAYMENT, headers=headers)
    assert down.status_code == 503
    assert down.headers["retry-after"] == "1"
    executions.assert_ran_times("order-3", 0)

    retry = await client.post("/payments", json=PAYMENT, headers=headers)
    assert retry.status_code == 201
    executions.assert_ran_once("order-3")


@pytest.mark.asyncio
async def test_a_stalled_store_answers_503(
    client: httpx.AsyncClient, store: FaultyStore, executions: Executions
) -> None:
    async with store.stall("try_acquire") as stall:
        response = await client.post(
            "/payments", json=PAYMENT, headers={"Idempotency-Key": "order-4"}
        )
    assert stall.calls == 1
    assert response.status_code == 503
    executions.assert_ran_times("order-4", 0)


@pytest.mark.asyncio
async def test_a_key_is_reusable_once_its_record_expired(executions: Executions) -> None:
    clock = FakeClock()  # the memory store and the middleware share it: no waiting a day
    store = MemoryStore(clock=clock)
    headers = {"Idempotency-Key": "order-5"}
    async with client_for(store, fake_provider(executions), clock=clock) as client:
        await client.post("/payments", json=PAYMENT, headers=headers)
        clock.advance(24 * 3600 + 1)  # the default ttl_hours is 24
        again = await client.post("/payments", json=PAYMENT, headers=headers)
    assert again.status_code == 201
    assert "x-idempotent-replay" not in again.headers
    executions.assert_ran_times("order-5", 2)
