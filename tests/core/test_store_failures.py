"""Store failures as the middleware sees them, with MemoryStore made to fail on purpose.

The same paths against a real Redis and PostgreSQL server that is stopped or frozen are in the
store-specific outage tests.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable

import pytest

from starlette_idempotency import MemoryStore
from starlette_idempotency.stores import AcquireResult, FencedWrite, IdempotencyRecord
from tests.support.broken_store import BrokenStore
from tests.support.guarded import make_guarded_app

PAYMENT = {"amount": "10.00", "currency": "EUR"}


@pytest.mark.parametrize("hang", [False, True], ids=["error", "timeout"])
async def test_fail_closed_answers_503_without_running(kind: str, hang: bool) -> None:
    store = BrokenStore(failing={"try_acquire"}, hang=hang)
    harness = await make_guarded_app(kind, store, store_timeout_seconds=0.05)
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "error" in response.json()
    assert harness.ledger.executions["payments"] == 0


class RaisingAsCalledStore(MemoryStore):
    """A store whose try_acquire raises as it is called, before it has an awaitable to give."""

    def try_acquire(  # type: ignore[override]
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> Awaitable[AcquireResult]:
        raise ConnectionError("try_acquire failed")


async def test_a_store_call_that_raises_as_it_is_called_is_a_store_failure(kind: str) -> None:
    harness = await make_guarded_app(kind, RaisingAsCalledStore())
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 503
    assert harness.ledger.executions["payments"] == 0


async def test_fail_open_runs_the_handler_unprotected(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = BrokenStore(failing={"try_acquire"})
    harness = await make_guarded_app(kind, store, on_store_error="fail_open")
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        for _ in range(2):
            response = await harness.client.post(
                "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
            )
            assert response.status_code == 201
    assert harness.ledger.executions["payments"] == 2
    assert any("fail_open" in record.getMessage() for record in caplog.records)


async def test_save_failure_still_answers_the_client(kind: str) -> None:
    store = BrokenStore(failing={"finish"})
    harness = await make_guarded_app(kind, store)
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 201
    assert response.json()["paymentId"] == "p_1"
    retry = await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 409  # the lock still holds until its TTL
    assert harness.ledger.executions["payments"] == 1


class FirstSpellingStore(MemoryStore):
    """A store written for the protocol's first spelling: it overrides complete(), not finish()."""

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        raise ConnectionError("complete failed")


async def test_a_store_overriding_the_first_spelling_complete_is_still_called(kind: str) -> None:
    harness = await make_guarded_app(kind, FirstSpellingStore())
    # Starlette builds the middleware on the first request: that is where it warns.
    with pytest.warns(DeprecationWarning, match=r"overrides complete\(\)"):
        response = await harness.client.post(
            "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
        )
    assert response.status_code == 201
    retry = await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert retry.status_code == 409  # its complete() failed: the lock still holds
    assert harness.ledger.executions["payments"] == 1


async def test_recovers_when_the_store_comes_back(kind: str) -> None:
    store = BrokenStore(failing={"try_acquire"})
    harness = await make_guarded_app(kind, store)
    headers = {"Idempotency-Key": "k"}
    assert (
        await harness.client.post("/payments", json=PAYMENT, headers=headers)
    ).status_code == 503
    store.failing.clear()
    assert (
        await harness.client.post("/payments", json=PAYMENT, headers=headers)
    ).status_code == 201
