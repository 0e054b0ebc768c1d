"""A handler that blocks its event loop for longer than its lock, on one of two pods.

``POST /compute`` (``lock_ttl_seconds=2``) computes for 4 s in an ``async def`` without an
await: its loop cannot renew the lock. The lock watchdog, a thread with a store connection of
its own, renews it, so a retry on the other pod at 2.8 s is answered 409 instead of running
the handler a second time; the blocked loop is logged with its route and counted.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from tests.stores.pod_app import COMPUTE_LOCK_TTL_SECONDS
from tests.support.conditions import eventually
from tests.support.pods import Pods

RETRY_AFTER_SECONDS = 2.8


async def runs(pods: Pods, key: str) -> list[int]:
    return [(await pod.get(f"/_runs/{key}")).json()["runs"] for pod in (pods.holder, pods.retrier)]


async def test_a_handler_that_blocks_its_loop_past_its_lock_runs_once(pods: Pods) -> None:
    key = f"compute-{uuid.uuid4().hex[:12]}"
    headers = {"Idempotency-Key": key}
    sent = time.monotonic()
    first = asyncio.create_task(pods.holder.post("/compute", json={}, headers=headers))
    # The holder's loop is blocked from here on: wait for the lock to be older than its TTL
    # (the condition under test is the lock's age), then retry on the other pod.
    while time.monotonic() - sent < RETRY_AFTER_SECONDS:  # noqa: ASYNC110 - the clock itself
        await asyncio.sleep(0.05)
    assert not first.done(), "the handler did not block for long enough"

    retry = await pods.retrier.post("/compute", json={}, headers=headers)

    assert retry.status_code == 409, f"{retry.status_code} {retry.text}"
    assert (await first).status_code == 201
    replay = await pods.retrier.post("/compute", json={}, headers=headers)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert await runs(pods, key) == [1, 0]

    async def reported() -> dict[str, object] | None:
        observed: dict[str, object] = (await pods.holder.get("/_observed")).json()
        return observed if observed["timeouts"] else None

    observed = await eventually(reported, message="the blocked loop to be counted")
    assert observed["timeouts"] == {"POST /compute event_loop_blocked": 1}
    [warning] = [w for w in observed["warnings"] if "POST /compute" in w]  # type: ignore[attr-defined]
    assert "event loop has been blocked" in warning
    assert f"lock_ttl_seconds={COMPUTE_LOCK_TTL_SECONDS:g}" in warning
    assert "renews its lock from a thread of its own" in warning
