"""The ``Retry-After`` of a 409 "in progress": a quarter of the time the first request has run,
rounded up, at least 1 s and at most what is left of its lock."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, checkpoint, idempotent
from starlette_idempotency._responses import retry_after_seconds
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from starlette_idempotency.testing import FakeClock
from tests.support.guarded import GuardedApp, make_client, make_guarded_app

NOW = 1_800_000_000.0
PAYMENT = {"amount": "10.00", "currency": "EUR"}


def running_for(
    age: float, lock_left: float, *, locked_until: float | None = None
) -> IdempotencyRecord:
    return IdempotencyRecord(
        key="k",
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint="sha256:0",
        owner_token="t",
        created_at=NOW - age,
        expires_at=NOW + lock_left,
        locked_until=locked_until,
    )


@pytest.mark.parametrize(
    ("age", "lock_left", "expected"),
    [
        (0.0, 30.0, 1),  # just started: come back in a second
        (4.0, 26.0, 1),
        (4.1, 25.9, 2),  # a quarter of the age, rounded up
        (12.0, 29.0, 3),  # renewed: the hint does not grow with the lock
        (40.0, 20.0, 10),
        (120.0, 20.0, 20),  # capped by what is left of the lock
        (20.0, 0.4, 1),  # a lock about to lapse: at least 1 s
        (40.0, -3.0, 1),  # already lapsed
        (-5.0, 30.0, 1),  # the holder's clock runs ahead of ours
    ],
)
def test_rule(age: float, lock_left: float, expected: int) -> None:
    assert retry_after_seconds(running_for(age, lock_left), NOW) == expected


def test_an_unknown_record_gets_one_second() -> None:
    assert retry_after_seconds(None, NOW) == 1


def test_a_record_with_recovery_points_is_capped_by_its_lease() -> None:
    # Such a record is kept for the retention TTL; its lock is locked_until.
    record = running_for(40.0, 86_400.0, locked_until=NOW + 3.0)
    assert retry_after_seconds(record, NOW) == 3


async def test_a_duplicate_is_told_to_come_back_soon_not_when_the_lock_ends(kind: str) -> None:
    harness = await make_guarded_app(kind)
    first = asyncio.create_task(
        harness.client.post(
            "/payments", json=PAYMENT, headers={"Idempotency-Key": "k", "x-gate": "g"}
        )
    )
    async with asyncio.timeout(5):
        await harness.ledger.entered_event("g").wait()
    assert await retry_after_of(harness) == "1"  # the lock has 30 s left
    harness.clock.advance(12.0)
    assert await retry_after_of(harness) == "3"
    harness.ledger.gate("g").set()
    assert (await first).status_code == 201


async def test_the_remaining_lock_caps_the_hint(kind: str) -> None:
    harness = await make_guarded_app(kind)  # /short-lock: 5 s lock, no renewal
    first = asyncio.create_task(
        harness.client.post(
            "/short-lock", json=PAYMENT, headers={"Idempotency-Key": "k", "x-gate": "s"}
        )
    )
    async with asyncio.timeout(5):
        await harness.ledger.entered_event("s").wait()
    harness.clock.advance(4.5)  # a quarter of the age is 2 s; 0.5 s of lock is left
    assert await retry_after_of(harness, "/short-lock") == "1"
    harness.ledger.gate("s").set()
    await first


async def retry_after_of(harness: GuardedApp, path: str = "/payments") -> str:
    response = await harness.client.post(path, json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert response.status_code == 409
    return response.headers["retry-after"]


async def test_a_handler_past_a_recovery_point_is_not_a_day_away() -> None:
    clock = FakeClock()
    entered, release = asyncio.Event(), asyncio.Event()

    @idempotent(lock_ttl_seconds=30)
    async def pay(request: Request) -> Response:
        await checkpoint(request, "provider_charge_sent", {"ref": "r1"})
        entered.set()
        await release.wait()
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(clock=clock), clock=clock)],
    )
    async with make_client(app) as client:
        first = asyncio.create_task(client.post("/pay", json={}, headers={"Idempotency-Key": "k"}))
        async with asyncio.timeout(5):
            await entered.wait()
        clock.advance(8.0)
        duplicate = await client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        release.set()
        assert (await first).status_code == 201
    assert duplicate.status_code == 409
    assert duplicate.headers["retry-after"] == "2"
