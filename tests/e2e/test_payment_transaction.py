"""A pod killed right after ``POST /payments`` committed, before its response, through nginx.

On ``PostgresStore`` the demo commits the payment, its outbox event and the idempotency record
in one transaction (``idempotency_transaction``): the client's retry is replayed, and the
database holds one payment and one outbox event. On ``RedisStore`` the record is written after
that commit, so the retry runs the payment again once the lock lapses; the provider, called
with the derived key, still charges once. ``X-Demo-Crash: after-commit`` makes the pod SIGKILL
itself (the e2e clusters run with ``DEMO_CRASH_HOOKS=1``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from examples.payments.cluster import Cluster

from tests.support.conditions import eventually
from tests.support.e2e import (
    LOCK_TTL_SECONDS,
    new_key,
    outbox_rows,
    payment_body,
    payment_rows,
    post,
    provider_charges,
)

pytestmark = pytest.mark.e2e

CRASH = {"X-Demo-Crash": "after-commit"}


async def crash_after_commit(
    cluster: Cluster, client: httpx.AsyncClient, body: dict[str, Any], key: str
) -> str:
    """Send the payment through nginx with the crash hook; returns the pod that died. nginx
    does not resend a POST, so the client gets a 502."""
    crashed = await post(client, "/payments", body, key=key, headers=CRASH)
    assert crashed.status_code == 502, crashed.text

    def dead_pod() -> str | None:
        dead = [pod.name for pod in cluster.pods.values() if not pod.running]
        return dead[0] if dead else None

    name = await eventually(dead_pod, timeout=10, interval=0.05, message="the pod to die")
    assert [pod.name for pod in cluster.pods.values() if not pod.running] == [name]
    return name


async def restart(cluster: Cluster, client: httpx.AsyncClient, name: str) -> None:
    """Start the dead pod again and wait until nginx sends it requests: nginx takes a pod that
    failed out of its rotation for a while (fail_timeout), and a test that then kills the other
    pod would find no pod to send a GET to."""
    cluster.start_pod(name)

    async def routed() -> bool | None:
        response = await client.get("/healthz")
        return True if response.headers.get("x-pod-id") == name else None

    await eventually(routed, timeout=15, interval=0.1, message=f"nginx to route to {name}")


async def retry_through_nginx(
    client: httpx.AsyncClient, body: dict[str, Any], key: str
) -> httpx.Response:
    """The client's retry through nginx until it is answered (502: nginx tried the dead pod;
    409: the key is still locked)."""

    async def answered() -> httpx.Response | None:
        response = await post(client, "/payments", body, key=key)
        return None if response.status_code in (409, 502) else response

    return await eventually(
        answered, timeout=LOCK_TTL_SECONDS + 15, interval=0.1, message="an answer to the retry"
    )


async def test_crash_after_the_commit_is_replayed_with_one_payment_and_one_outbox_event(
    postgres_cluster: Cluster,
) -> None:
    cluster = postgres_cluster
    body, key = payment_body(), new_key("fenced")
    reference = body["merchantReference"]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as client:
        dead = await crash_after_commit(cluster, client, body, key)

        retry = await retry_through_nginx(client, body, key)
        assert retry.status_code == 200, retry.text
        assert retry.headers["x-idempotent-replay"] == "true"
        assert retry.headers["x-pod-id"] != dead  # the live pod answered ...
        payment = retry.json()
        assert payment["pod"] == dead  # ... with what the dead one committed

        payments = await payment_rows(client, cluster.url, reference)
        assert payments == [payment]
        events = await outbox_rows(client, cluster.url, reference)
        assert [(event["eventType"], event["payload"]["id"]) for event in events] == [
            ("payment.created", payment["id"])
        ]
        charges = await provider_charges(client, cluster.url, reference)
        assert [charge["providerRef"] for charge in charges] == [
            events[0]["payload"]["providerRef"]
        ]

        await restart(cluster, client, dead)  # both pods replay it
        for pod in cluster.pods.values():
            again = await post(client, f"{pod.url}/payments", body, key=key)
            assert again.headers["x-idempotent-replay"] == "true"
            assert again.content == retry.content
        assert len(await payment_rows(client, cluster.url, reference)) == 1


async def test_on_redis_a_crash_after_the_commit_runs_the_payment_again_but_charges_once(
    redis_cluster: Cluster,
) -> None:
    """What the transaction is for: without it, the rows committed but the record did not, so
    the retry runs once the lock lapses. Only the provider's derived key keeps the charge
    once."""
    cluster = redis_cluster
    body, key = payment_body(), new_key("unfenced")
    reference = body["merchantReference"]
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as client:
        dead = await crash_after_commit(cluster, client, body, key)

        retry = await retry_through_nginx(client, body, key)
        assert retry.status_code == 200, retry.text
        assert "x-idempotent-replay" not in retry.headers
        assert retry.json()["pod"] != dead

        payments = await payment_rows(client, cluster.url, reference)
        assert sorted(row["pod"] for row in payments) == sorted([dead, retry.json()["pod"]])
        assert len(await outbox_rows(client, cluster.url, reference)) == 2
        charges = await provider_charges(client, cluster.url, reference)
        assert [charge["pod"] for charge in charges] == [dead]
        await restart(cluster, client, dead)
