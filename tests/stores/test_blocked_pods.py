"""A handler that blocks its event loop for longer than its lock, on one of two pods: the
honest lease.

``POST /compute`` (``lock_ttl_seconds=2``) computes for 4 s in an ``async def`` without an
await: its loop cannot renew the lock, and nothing else does (the library starts no thread).
So a retry on the other pod after the lock lapsed takes the key over and runs the handler
again: what this handler does is not fenced (``test_transaction_pods`` shows the same block
with its effects fenced, charged and paid once). The retry's answer is the one stored, the
blocked attempt's write is refused, and the blocked loop is logged with its route and counted
once it runs again.
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


async def test_a_handler_that_blocks_its_loop_past_its_lock_loses_its_key(pods: Pods) -> None:
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

    assert retry.status_code == 201, f"{retry.status_code} {retry.text}"
    assert retry.json() == {"pod": "retrier"}
    assert (await first).status_code == 201  # sent to its client, but not stored
    replay = await pods.holder.post("/compute", json={}, headers=headers)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.json() == {"pod": "retrier"}
    assert await runs(pods, key) == [1, 1]

    async def reported() -> dict[str, object] | None:
        observed: dict[str, object] = (await pods.holder.get("/_observed")).json()
        return observed if observed["timeouts"] else None

    observed = await eventually(reported, message="the blocked loop to be counted")
    # Blocked, and its outcome refused: the retry owned the key by then.
    assert observed["timeouts"] == {
        "POST /compute event_loop_blocked": 1,
        "POST /compute lock_lost": 1,
    }
    [warning] = [w for w in observed["warnings"] if "POST /compute" in w]  # type: ignore[attr-defined]
    assert "event loop was blocked" in warning
    assert f"lock_ttl_seconds={COMPUTE_LOCK_TTL_SECONDS:g}" in warning
