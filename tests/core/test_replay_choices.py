"""Smaller choices: fingerprint version changes across a deploy, replay="reject",
max_response_bytes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyEvent, IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client

HEADERS = {"Idempotency-Key": "k"}


def deploy(
    store: MemoryStore, runs: Counter[str], events: list[IdempotencyEvent], **options: Any
) -> Any:
    """One release of the app: the same store survives across deploys."""

    @idempotent(**options)
    async def pay(request: Request) -> Response:
        runs["pay"] += 1
        return JSONResponse(
            {"n": runs["pay"], "blob": "x" * 100},
            status_code=201,
            headers={"Location": f"/payments/{runs['pay']}"},
        )

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return make_client(IdempotencyMiddleware(app, store=store, on_event=events.append))


@pytest.mark.parametrize(("policy", "status"), [("replay", 201), ("reject", 422)])
async def test_fingerprint_version_change_across_a_deploy(policy: str, status: int) -> None:
    store, runs = MemoryStore(), Counter[str]()
    events: list[IdempotencyEvent] = []
    old = deploy(store, runs, events)
    await old.post("/pay", json={"amount": 1}, headers=HEADERS)
    new = deploy(store, runs, events, fingerprint_version="2", on_fingerprint_change=policy)
    # even a body that the old scheme would call different is trusted under "replay"
    retry = await new.post("/pay", json={"amount": 1, "extra": True}, headers=HEADERS)
    assert retry.status_code == status
    assert runs["pay"] == 1
    assert events[-1].note == "fingerprint_version_changed"
    assert events[-1].result == ("REPLAYED" if policy == "replay" else "MISMATCH")


async def test_same_version_still_compares_fingerprints() -> None:
    store, runs = MemoryStore(), Counter[str]()
    events: list[IdempotencyEvent] = []
    app = deploy(store, runs, events, fingerprint_version="2")
    await app.post("/pay", json={"amount": 1}, headers=HEADERS)
    assert (await app.post("/pay", json={"amount": 2}, headers=HEADERS)).status_code == 422


async def test_replay_reject_answers_409_with_location() -> None:
    store, runs = MemoryStore(), Counter[str]()
    events: list[IdempotencyEvent] = []
    app = deploy(store, runs, events, replay="reject")
    await app.post("/pay", json={}, headers=HEADERS)
    again = await app.post("/pay", json={}, headers=HEADERS)
    assert again.status_code == 409
    assert again.headers["location"] == "/payments/1"
    assert "already processed" in again.json()["error"]
    assert "retry-after" not in again.headers
    assert runs["pay"] == 1


async def test_oversized_response_is_completed_but_replayed_without_body() -> None:
    store, runs = MemoryStore(), Counter[str]()
    events: list[IdempotencyEvent] = []
    app = deploy(store, runs, events, max_response_bytes=50)
    first = await app.post("/pay", json={}, headers=HEADERS)
    assert first.status_code == 201
    assert len(first.content) > 50
    replay = await app.post("/pay", json={}, headers=HEADERS)
    assert replay.status_code == 201
    assert replay.content == b""
    assert replay.headers["x-idempotent-body-omitted"] == "true"
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.headers["location"] == "/payments/1"
    assert "content-type" not in replay.headers
    assert runs["pay"] == 1
