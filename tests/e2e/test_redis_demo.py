"""Scenario 7 (Redis down) and the demo's other routes, on the Redis-backed cluster."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from examples.payments.cluster import Cluster

from tests.support.conditions import eventually
from tests.support.e2e import first_payment, new_key, order_rows, payment_body, payment_rows, post

pytestmark = pytest.mark.e2e


@pytest.fixture
async def client(redis_cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=redis_cluster.url, timeout=30.0) as http:
        yield http


async def test_key_replays_after_both_pods_restart(
    redis_cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body, key, first = await first_payment(client)
    redis_cluster.restart_pods()
    for pod in redis_cluster.pods.values():
        replay = await post(client, f"{pod.url}/payments", body, key=key)
        assert replay.status_code == 200
        assert replay.headers["x-idempotent-replay"] == "true"
        assert replay.content == first.content
    assert len(await payment_rows(client, redis_cluster.url, body["merchantReference"])) == 1


async def test_members_retryable_failure_then_success_with_the_same_key(
    redis_cluster: Cluster, client: httpx.AsyncClient
) -> None:
    taken = f"taken-{uuid.uuid4().hex}@example.com"
    free = f"free-{uuid.uuid4().hex}@example.com"
    created = await post(client, "/members", {"email": taken, "name": "First"}, key=new_key())
    assert created.status_code == 200

    key = new_key("member")
    duplicate = await post(client, "/members", {"email": taken, "name": "Second"}, key=key)
    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "duplicate_email"
    assert "x-idempotent-replay" not in duplicate.headers
    # The failure was marked retryable, so the key was released: the fixed request, with the
    # same key, runs (a stored failure would have answered 422 for the new body).
    fixed = await post(client, "/members", {"email": free, "name": "Second"}, key=key)
    assert fixed.status_code == 200, fixed.text
    assert fixed.json()["email"] == free
    again = await post(client, "/members", {"email": free, "name": "Second"}, key=key)
    assert again.headers["x-idempotent-replay"] == "true"
    assert again.content == fixed.content


async def test_patch_member_key_is_optional(client: httpx.AsyncClient) -> None:
    email = f"patch-{uuid.uuid4().hex}@example.com"
    member = (await post(client, "/members", {"email": email, "name": "A"}, key=new_key())).json()
    url = f"/members/{member['id']}"
    without_key = await client.patch(url, json={"name": "B"})
    assert without_key.status_code == 200
    assert without_key.json()["name"] == "B"
    key = new_key("patch")
    first = await client.patch(url, json={"name": "C"}, headers={"Idempotency-Key": key})
    replay = await client.patch(url, json={"name": "C"}, headers={"Idempotency-Key": key})
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.content == first.content


async def test_excluded_fields_are_ignored_across_pods(
    redis_cluster: Cluster, client: httpx.AsyncClient
) -> None:
    reference, key = f"order-{uuid.uuid4().hex}", new_key("order")

    def order(timestamp: str, nonce: str) -> dict[str, object]:
        return {
            "orderReference": reference,
            "accountId": "acc-e2e",
            "items": [{"sku": "sku-apple", "quantity": 2}],
            "clientTimestamp": timestamp,
            "requestNonce": nonce,
        }

    pod_a, pod_b = redis_cluster.pods["pod-a"], redis_cluster.pods["pod-b"]
    first = await post(
        client, f"{pod_a.url}/orders/submit", order("2026-01-01T10:00:00Z", "n1"), key=key
    )
    assert first.status_code == 200
    retry = await post(
        client, f"{pod_b.url}/orders/submit", order("2026-01-01T10:00:07Z", "n2"), key=key
    )
    assert retry.status_code == 200
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.headers["x-pod-id"] == "pod-b"
    assert retry.content == first.content
    # A field that is not excluded still counts.
    changed = order("2026-01-01T10:00:09Z", "n3")
    changed["items"] = [{"sku": "sku-apple", "quantity": 3}]
    assert (await post(client, "/orders/submit", changed, key=key)).status_code == 422
    assert len(await order_rows(client, redis_cluster.url, reference)) == 1


async def test_nginx_never_resends_a_post_to_the_other_pod(
    redis_cluster: Cluster, client: httpx.AsyncClient
) -> None:
    redis_cluster.kill_pod("pod-a")
    try:
        # Round robin sends one of the next POSTs to the dead pod (or, had it been marked
        # failed already, once its fail_timeout has passed): nginx must answer 502 instead of
        # quietly resending it to pod-b.
        async def refused() -> tuple[dict[str, str], str] | None:
            body, key = payment_body(), new_key()
            response = await post(client, "/payments", body, key=key)
            if response.status_code == 502:
                return body, key
            assert response.status_code == 200
            assert response.headers["x-pod-id"] == "pod-b"
            return None

        body, key = await eventually(
            refused, timeout=15, interval=0.25, message="a POST routed to the dead pod"
        )
        assert await payment_rows(client, redis_cluster.url, body["merchantReference"]) == []
        # The client retries with the same key; it runs once, on the live pod.
        retry = await post(client, "/payments", body, key=key)
        assert retry.status_code == 200
        assert retry.json()["pod"] == "pod-b"
        assert len(await payment_rows(client, redis_cluster.url, body["merchantReference"])) == 1
        # GETs are safe to resend, and keep being served.
        for _ in range(2):
            health = await client.get("/healthz")
            assert health.status_code == 200
            assert health.headers["x-pod-id"] == "pod-b"
    finally:
        redis_cluster.start_pod("pod-a")


async def test_7_redis_down_is_503_and_writes_nothing_then_recovers(
    redis_cluster: Cluster, client: httpx.AsyncClient
) -> None:
    body, key = payment_body(), new_key()
    redis_cluster.stop_redis()
    try:
        for pod in redis_cluster.pods.values():
            down = await post(client, f"{pod.url}/payments", body, key=key)
            assert down.status_code == 503
            assert down.headers["retry-after"] == "1"
        through_nginx = await post(client, "/payments", body, key=key)
        assert through_nginx.status_code == 503
        assert await payment_rows(client, redis_cluster.url, body["merchantReference"]) == []
    finally:
        redis_cluster.start_redis()

    async def served() -> httpx.Response | None:
        response = await post(client, "/payments", body, key=key)
        return None if response.status_code == 503 else response

    # No restart of the pods: their Redis clients reconnect by themselves.
    recovered = await eventually(
        served, timeout=10, interval=0.1, message="the pods to reach Redis again"
    )
    assert recovered.status_code == 200, recovered.text
    replay = await post(client, "/payments", body, key=key)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert len(await payment_rows(client, redis_cluster.url, body["merchantReference"])) == 1
