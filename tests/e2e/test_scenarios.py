"""The design's scenarios 1 to 6, through nginx and two real pods, on each idempotency store.

Scenario 7 (the store going down) is Redis-only: see ``test_redis_demo.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from examples.payments.cluster import Cluster

from tests.support.conditions import eventually
from tests.support.e2e import (
    LOCK_TTL_SECONDS,
    first_payment,
    new_key,
    outbox_rows,
    payment_body,
    payment_rows,
    post,
    provider_charges,
)

pytestmark = pytest.mark.e2e


async def test_1_missing_key_is_400_and_writes_nothing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body = payment_body()
    response = await post(client, "/payments", body, key=None)
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]
    assert response.headers["x-pod-id"] in cluster.pods
    assert await payment_rows(client, cluster.url, body["merchantReference"]) == []


async def test_2_first_request_runs_and_writes_one_row(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body = payment_body()
    response = await post(client, "/payments", body, key=new_key())
    assert response.status_code == 200
    payment = response.json()
    assert payment["merchantReference"] == body["merchantReference"]
    assert payment["amount"] == body["amount"]
    assert payment["pod"] == response.headers["x-pod-id"]
    assert "x-idempotent-replay" not in response.headers
    rows = await payment_rows(client, cluster.url, body["merchantReference"])
    assert [row["id"] for row in rows] == [payment["id"]]


async def test_3_same_key_again_replays_without_running(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body, key, first = await first_payment(client)
    # Sent to each pod directly: the one that ran it and the one that did not.
    for pod in cluster.pods.values():
        replay = await post(client, f"{pod.url}/payments", body, key=key)
        assert replay.status_code == 200
        assert replay.headers["x-idempotent-replay"] == "true"
        assert replay.headers["x-pod-id"] == pod.name
        assert replay.content == first.content
    assert len(await payment_rows(client, cluster.url, body["merchantReference"])) == 1


async def test_4_same_key_other_body_is_422(cluster: Cluster, client: httpx.AsyncClient) -> None:
    body, key = payment_body(amount="10.00"), new_key()
    assert (await post(client, "/payments", body, key=key)).status_code == 200
    reused = await post(client, "/payments", {**body, "amount": "99.00"}, key=key)
    assert reused.status_code == 422
    assert "different request payload" in reused.json()["error"]
    rows = await payment_rows(client, cluster.url, body["merchantReference"])
    assert [row["amount"] for row in rows] == ["10.00"]


async def test_5_same_key_on_both_pods_at_once_one_200_one_409(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body, key = payment_body(), new_key()
    # Both carry the demo delay: whichever acquires the key first is still sleeping when the
    # other one arrives, so the other one finds it in progress.
    slow = {"X-Demo-Delay-Ms": "1500"}
    a, b = await asyncio.gather(
        post(client, f"{cluster.pods['pod-a'].url}/payments", body, key=key, headers=slow),
        post(client, f"{cluster.pods['pod-b'].url}/payments", body, key=key, headers=slow),
    )
    assert sorted([a.status_code, b.status_code]) == [200, 409]
    ok, conflict = (a, b) if a.status_code == 200 else (b, a)
    assert ok.headers["x-pod-id"] != conflict.headers["x-pod-id"]
    assert int(conflict.headers["retry-after"]) >= 1
    assert "already being processed" in conflict.json()["error"]
    assert len(await payment_rows(client, cluster.url, body["merchantReference"])) == 1
    retry = await post(client, "/payments", body, key=key)
    assert retry.status_code == 200
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.content == ok.content


async def test_6_pod_crash_mid_request_retry_on_other_pod_runs_after_lock_ttl(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body, key = payment_body(), new_key()
    reference = body["merchantReference"]
    pod_a, pod_b = cluster.pods["pod-a"], cluster.pods["pod-b"]
    # pod-a holds the key and waits on the demo delay, before its ledger insert.
    await kill_pod_a_while_delayed(
        cluster, client, "/payments", body, key, delay_header="X-Demo-Delay-Ms"
    )
    crashed_at = asyncio.get_running_loop().time()

    # The retry goes to pod-b: 409 while the dead pod's lock lives, then it runs.
    async def retried() -> httpx.Response | None:
        response = await post(client, f"{pod_b.url}/payments", body, key=key)
        return None if response.status_code == 409 else response

    response = await eventually(
        retried, timeout=LOCK_TTL_SECONDS + 10, interval=0.1, message="the lock to lapse"
    )
    waited = asyncio.get_running_loop().time() - crashed_at
    assert response.status_code == 200, response.text
    assert response.json()["pod"] == "pod-b"
    assert "x-idempotent-replay" not in response.headers
    assert waited >= LOCK_TTL_SECONDS * 0.5  # it did wait for the lock, not run at once
    rows = await payment_rows(client, cluster.url, reference)
    assert [row["pod"] for row in rows] == ["pod-b"]
    # pod-a charged the provider before it died; pod-b's call, with the same derived key, got
    # that charge back instead of charging again.
    charges = await provider_charges(client, cluster.url, reference)
    assert [charge["pod"] for charge in charges] == ["pod-a"]
    events = await outbox_rows(client, cluster.url, reference)
    assert [event["payload"]["id"] for event in events] == [rows[0]["id"]]
    assert events[0]["payload"]["providerRef"] == charges[0]["providerRef"]

    cluster.start_pod("pod-a")
    replay = await post(client, f"{pod_a.url}/payments", body, key=key)
    assert replay.status_code == 200
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.content == response.content
    assert len(await payment_rows(client, cluster.url, reference)) == 1


async def test_crash_after_the_provider_call_charges_exactly_once(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The unknown outcome: the provider charged, pod-a died before storing anything. The retry
    on pod-b finds the recovery point, asks the provider, and does not charge again."""
    body, key = payment_body(), new_key("charge")
    reference = body["merchantReference"]
    pod_b = cluster.pods["pod-b"]
    await kill_pod_a_while_delayed(
        cluster, client, "/charges", body, key, delay_header="X-Demo-Delay-After-Provider-Ms"
    )

    async def retried() -> httpx.Response | None:
        response = await post(client, f"{pod_b.url}/charges", body, key=key)
        return None if response.status_code == 409 else response

    try:
        response = await eventually(
            retried, timeout=LOCK_TTL_SECONDS + 10, interval=0.1, message="the lease to end"
        )
        assert response.status_code == 200, response.text
        assert response.json()["pod"] == "pod-b"
        charges = await provider_charges(client, cluster.url, reference)
        assert [charge["pod"] for charge in charges] == ["pod-a"]  # charged once, by pod-a
        assert len(await payment_rows(client, cluster.url, reference)) == 1
        replay = await post(client, f"{pod_b.url}/charges", body, key=key)
        assert replay.headers["x-idempotent-replay"] == "true"
        assert replay.content == response.content
    finally:
        cluster.start_pod("pod-a")


async def kill_pod_a_while_delayed(
    cluster: Cluster,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    key: str,
    *,
    delay_header: str,
) -> None:
    """Send the request to pod-a with a long demo delay, SIGKILL pod-a once its handler sleeps
    on it, and check that its client saw the connection die."""
    pod_a = cluster.pods["pod-a"]
    reference = body["merchantReference"]
    in_flight = asyncio.create_task(
        post(client, f"{pod_a.url}{path}", body, key=key, headers={delay_header: "60000"})
    )
    try:

        async def sleeping_on_pod_a() -> bool | None:
            response = await client.get(f"{pod_a.url}/demo/delayed")
            return True if reference in response.json()["merchantReferences"] else None

        await eventually(
            sleeping_on_pod_a, timeout=10, interval=0.1, message="pod-a to be inside the handler"
        )
        cluster.kill_pod("pod-a")
        with pytest.raises(httpx.TransportError):
            await in_flight
    finally:
        in_flight.cancel()
