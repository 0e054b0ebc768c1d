"""Webhook receivers through a real uvicorn process on Redis: keys from another header, a JSON
field at depth and a function of the request and its body (``key_from``); concurrent deliveries;
a route that stores its 500s (``release_statuses=()``); a UUID-only route (``key_format``); the
422 naming the first request."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from starlette_idempotency.testing._isolation import delete_prefixed_at, unique_prefix
from tests.e2e.apps.webhooks import github_signature
from tests.support.conditions import eventually
from tests.support.uvicorn import UvicornServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


@pytest.fixture(scope="module")
def prefix() -> str:
    return unique_prefix()


@pytest.fixture(scope="module")
def server(redis_url: str, prefix: str) -> Iterator[UvicornServer]:
    env = {"IDEM_TEST_REDIS_URL": redis_url, "IDEM_TEST_PREFIX": prefix}
    with UvicornServer("tests.e2e.apps.webhooks:create_app", env=env, factory=True) as app:
        yield app


@pytest.fixture
async def client(server: UvicornServer, redis_url: str, prefix: str) -> AsyncIterator[Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=15) as http:
        yield http
    await delete_prefixed_at(redis_url, prefix)


def new_id() -> str:
    return f"evt_{uuid.uuid4().hex}"


async def runs(client: httpx.AsyncClient, path: str, key: str) -> int:
    counted: dict[str, int] = (await client.get("/state")).json()
    return counted.get(f"{path} {key}", 0)


def github_delivery(body: dict[str, Any], delivery: str | None) -> dict[str, Any]:
    """What ``client.post`` sends for a GitHub delivery of ``body``, signed."""
    content = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "X-Hub-Signature-256": github_signature(content)}
    if delivery is not None:
        headers["X-GitHub-Delivery"] = delivery
    return {"content": content, "headers": headers}


def assert_replay(first: httpx.Response, retry: httpx.Response) -> None:
    assert retry.status_code == first.status_code
    assert retry.content == first.content
    assert retry.headers["x-idempotent-replay"] == "true"
    assert "x-idempotent-replay" not in first.headers


async def test_a_header_source_runs_a_delivery_once(client: httpx.AsyncClient) -> None:
    delivery = new_id()
    first = await client.post("/standard", json={"type": "a"}, headers={"webhook-id": delivery})
    assert first.status_code == 200
    retry = await client.post("/standard", json={"type": "a"}, headers={"webhook-id": delivery})
    assert_replay(first, retry)
    # The route's key is its source alone: an Idempotency-Key beside it changes nothing.
    other = await client.post(
        "/standard",
        json={"type": "a"},
        headers={"webhook-id": delivery, "Idempotency-Key": "ignored"},
    )
    assert_replay(first, other)
    assert await runs(client, "/standard", delivery) == 1


async def test_a_json_field_at_depth_is_the_key(client: httpx.AsyncClient) -> None:
    event_id = new_id()
    event = {"event": {"type": "paid", "data": {"id": event_id, "amount": 5}}}
    first = await client.post("/nested", json=event)
    assert first.status_code == 200
    # The same event, its members in another order and spaced out: the same request.
    respaced = json.dumps(event, indent=2, sort_keys=True).encode()
    retry = await client.post(
        "/nested", content=respaced, headers={"Content-Type": "application/json"}
    )
    assert_replay(first, retry)
    assert await runs(client, "/nested", event_id) == 1


async def test_an_integer_field_is_a_key_too(client: httpx.AsyncClient) -> None:
    number = uuid.uuid4().int % 10**12
    event = {"event": {"data": {"id": number}}}
    first = await client.post("/nested", json=event)
    assert_replay(first, await client.post("/nested", json=event))
    assert await runs(client, "/nested", str(number)) == 1


async def test_a_function_source_verifies_the_signature_then_deduplicates(
    client: httpx.AsyncClient,
) -> None:
    delivery = new_id()
    body = {"action": "opened"}
    forged = github_delivery(body, delivery)
    for signature in ("sha256=" + "0" * 64, "sha256=²"):
        forged["headers"]["X-Hub-Signature-256"] = signature.encode("latin-1")
        refused = await client.post("/github", **forged)
        assert (refused.status_code, refused.text) == (401, "bad signature")
    first = await client.post("/github", **github_delivery(body, delivery))
    assert first.status_code == 200
    assert_replay(first, await client.post("/github", **github_delivery(body, delivery)))
    assert await runs(client, "/github", delivery) == 1


@pytest.mark.parametrize(
    ("path", "request_kwargs", "named"),
    [
        ("/standard", {"json": {"type": "a"}}, "webhook-id header is required"),
        ("/nested", {"json": {"event": {"data": {}}}}, "JSON field event.data.id"),
        ("/nested", {"json": {"event": {"data": {"id": None}}}}, "JSON field event.data.id"),
        ("/nested", {"json": [1, 2]}, "JSON field event.data.id"),
        ("/github", github_delivery({"action": "opened"}, None), "key_from github_delivery"),
    ],
    ids=["header", "json-field", "json-null", "json-array", "function"],
)
async def test_a_missing_key_is_400_naming_its_source(
    client: httpx.AsyncClient, path: str, request_kwargs: dict[str, Any], named: str
) -> None:
    before = (await client.get("/state")).json()
    response = await client.post(path, **request_kwargs)
    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert named in response.json()["error"]
    assert (await client.get("/state")).json() == before


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"event": {"data": {"id": {"nested": 1}}}}, "must be a string or an integer"),
        ({"event": {"data": {"id": True}}}, "must be a string or an integer"),
        ({"event": {"data": {"id": "é"}}}, "printable ASCII"),
        ({"event": {"data": {"id": ""}}}, "must not be empty"),
        ({"event": {"data": {"id": "k" * 256}}}, "must not exceed 255 characters"),
    ],
    ids=["object", "boolean", "non-ascii", "empty", "too-long"],
)
async def test_a_field_that_is_no_key_is_400(
    client: httpx.AsyncClient, event: dict[str, Any], message: str
) -> None:
    response = await client.post("/nested", json=event)
    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert message in response.json()["error"]
    assert response.json()["error"].startswith("JSON field event.data.id")


async def test_malformed_json_is_a_malformed_request(client: httpx.AsyncClient) -> None:
    before = (await client.get("/state")).json()
    response = await client.post(
        "/nested",
        content=b'{"event": {"data": {"id": "evt_1"',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["code"] == "request_malformed"
    assert "JSON field event.data.id" in response.json()["error"]
    assert (await client.get("/state")).json() == before


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_body_over_the_limit_is_413_before_its_key_is_read(
    client: httpx.AsyncClient, chunked: bool
) -> None:
    event_id = new_id()
    event = {"event": {"data": {"id": event_id}}, "padding": "x" * 2048}
    content = json.dumps(event).encode()

    async def streamed() -> AsyncIterator[bytes]:
        for at in range(0, len(content), 512):
            yield content[at : at + 512]

    response = await client.post(
        "/nested",
        content=streamed() if chunked else content,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert response.json()["code"] == "request_body_too_large"
    assert await runs(client, "/nested", event_id) == 0


async def test_a_delivery_retried_while_the_first_runs_waits_for_its_answer(
    client: httpx.AsyncClient,
) -> None:
    delivery, hold = new_id(), uuid.uuid4().hex
    headers = {"webhook-id": delivery, "X-Hold": hold}
    first = asyncio.create_task(client.post("/standard", json={"type": "a"}, headers=headers))
    await eventually(lambda: runs(client, "/standard", delivery), message="the first delivery")
    second = asyncio.create_task(client.post("/standard", json={"type": "a"}, headers=headers))
    # The second is waiting (on_in_progress="wait"), not answered, until the first ends.
    done, _ = await asyncio.wait({second}, timeout=0.5)
    assert not done
    await client.post(f"/release?name={hold}")
    first_answer, second_answer = await first, await second
    assert first_answer.status_code == 200
    assert_replay(first_answer, second_answer)
    assert await runs(client, "/standard", delivery) == 1


async def test_a_delivery_retried_while_the_first_runs_gets_409_then_the_replay(
    client: httpx.AsyncClient,
) -> None:
    delivery, hold = new_id(), uuid.uuid4().hex
    body = {"action": "opened"}
    held = github_delivery(body, delivery)
    held["headers"]["X-Hold"] = hold
    first = asyncio.create_task(client.post("/github", **held))
    await eventually(lambda: runs(client, "/github", delivery), message="the first delivery")
    conflict = await client.post("/github", **github_delivery(body, delivery))
    assert conflict.status_code == 409
    assert conflict.json()["code"] == "idempotency_key_in_use"
    assert int(conflict.headers["retry-after"]) >= 1
    await client.post(f"/release?name={hold}")
    first_answer = await first
    assert first_answer.status_code == 200
    assert_replay(first_answer, await client.post("/github", **github_delivery(body, delivery)))
    assert await runs(client, "/github", delivery) == 1


async def test_a_stripe_route_stores_its_500_and_replays_it(client: httpx.AsyncClient) -> None:
    event_id = new_id()
    event = {"id": event_id, "type": "charge.succeeded", "fail": True, "pending_webhooks": 2}
    first = await client.post("/stripe", json=event)
    assert first.status_code == 500
    assert first.json() == {"error": "downstream failed"}
    # Stripe's retry: the same event, fewer endpoints left to deliver it to.
    retry = await client.post("/stripe", json={**event, "pending_webhooks": 1})
    assert_replay(first, retry)
    assert await runs(client, "/stripe", event_id) == 1


async def test_a_handler_exception_is_stored_as_a_500_where_500s_are_kept(
    client: httpx.AsyncClient,
) -> None:
    event_id = new_id()
    event = {"id": event_id, "type": "charge.succeeded", "raise": True}
    # uvicorn closes a connection whose app raised: ask for that, so none is reused after it.
    first = await client.post("/stripe", json=event, headers={"Connection": "close"})
    assert first.status_code == 500
    retry = await client.post("/stripe", json=event)
    assert retry.status_code == 500
    assert retry.headers["x-idempotent-replay"] == "true"
    # The body the server built from the exception never passed through the middleware.
    assert retry.headers["x-idempotent-body-omitted"] == "true"
    assert await runs(client, "/stripe", event_id) == 1


async def test_a_uuid_only_route_refuses_abc_before_anything_is_stored_or_run(
    client: httpx.AsyncClient, redis_url: str, prefix: str
) -> None:
    refused = await client.post("/uuid", json={}, headers={"Idempotency-Key": "abc"})
    assert refused.status_code == 400
    assert refused.json()["code"] == "idempotency_key_invalid"
    assert "UUID" in refused.json()["error"]
    assert await runs(client, "/uuid", "abc") == 0
    admin = aioredis.from_url(redis_url)
    try:
        assert [key async for key in admin.scan_iter(match=f"{prefix}:*")] == []
    finally:
        await admin.aclose()
    key = str(uuid.uuid4())
    first = await client.post("/uuid", json={}, headers={"Idempotency-Key": key})
    assert first.status_code == 200
    assert_replay(first, await client.post("/uuid", json={}, headers={"Idempotency-Key": key}))


async def test_the_422_names_the_first_requests_status_and_location(
    client: httpx.AsyncClient,
) -> None:
    key = uuid.uuid4().hex
    first = await client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": key})
    assert first.status_code == 201
    reused = await client.post("/payments", json={"amount": 2}, headers={"Idempotency-Key": key})
    assert reused.status_code == 422
    assert reused.json()["code"] == "idempotency_key_reused"
    assert reused.json()["first_request"] == {
        "status": 201,
        "location": first.headers["location"],
    }
    # A webhook id reused for another event: the first one's status, and nothing of its body.
    event_id = new_id()
    stored = await client.post("/stripe", json={"id": event_id, "fail": True})
    other = await client.post("/stripe", json={"id": event_id, "type": "other"})
    assert stored.status_code == 500
    assert other.status_code == 422
    assert other.json()["first_request"] == {"status": 500}
    assert "downstream" not in other.text
