"""stripe-python against a guarded route over real HTTP, with ``error_format="stripe"``: its
error parser reads ``error`` as an object (``error_data.get("message")``), so each of the
middleware's errors must come back as a catchable ``stripe.StripeError`` subclass carrying the
stable code, never an AttributeError (which the default ``{"error": "<message>"}`` gives)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest
import stripe

from tests.support.live_server import LiveServer, plain_post, serve


@pytest.fixture(scope="module", params=["stripe", "json"])
def stripe_server(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The test app with ``error_format="stripe"``, and with the default ``"json"``, which
    answers Stripe's SDKs (``X-Stripe-Client-User-Agent``) in the shape they parse."""
    yield from serve(request.param)


@pytest.fixture
def stripe_client(stripe_server: LiveServer) -> Iterator[stripe.StripeClient]:
    http_client = stripe.RequestsClient()  # stripe-python's default transport
    try:
        yield stripe.StripeClient(
            "sk_test_local",
            base_addresses={"api": stripe_server.base_url},
            http_client=http_client,
            max_network_retries=0,
        )
    finally:
        http_client.close()  # type: ignore[no-untyped-call]  # stripe leaves it unannotated


def stripe_post(client: stripe.StripeClient, path: str, key: str, **params: str) -> None:
    client.raw_request("post", path, idempotency_key=key, **params)


async def paid_once(server: LiveServer, label: str, *, amount: str) -> str:
    """A new key (``label-<uuid>``) whose payment ran, sent without stripe-python."""
    key = f"{label}-{uuid.uuid4()}"
    first = await plain_post(server.base_url, "/payments", key, data={"amount": amount})
    assert first.status_code == 201
    return key


async def test_409_in_progress_is_a_stripe_error(
    stripe_client: stripe.StripeClient, stripe_server: LiveServer
) -> None:
    key = f"stripe-busy-{uuid.uuid4()}"
    entered, release = stripe_server.ledger.events(key)
    first = functools.partial(
        plain_post, stripe_server.base_url, "/held", key, data={"amount": "7"}
    )
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(first)
        try:
            assert await anyio.to_thread.run_sync(entered.wait, 5.0)
            call = functools.partial(stripe_post, stripe_client, "/held", key, amount="7")
            with pytest.raises(stripe.StripeError) as raised:
                await anyio.to_thread.run_sync(call)
        finally:
            release.set()  # the first request may finish now
    error = raised.value
    assert isinstance(error, stripe.APIError)  # stripe's class for a status it has none for
    assert error.http_status == 409
    assert error.error is not None
    assert error.error.code == "idempotency_key_in_use"
    assert error.error.type == "idempotency_error"
    assert "already being processed" in str(error)
    assert error.headers is not None
    assert error.headers["retry-after"] == "1"
    assert stripe_server.ledger.executions[key] == 1


async def test_422_key_reused_is_a_stripe_error(
    stripe_client: stripe.StripeClient, stripe_server: LiveServer
) -> None:
    key = await paid_once(stripe_server, "stripe-reused", amount="1")
    call = functools.partial(stripe_post, stripe_client, "/payments", key, amount="2")
    with pytest.raises(stripe.StripeError) as raised:
        await anyio.to_thread.run_sync(call)
    error = raised.value
    assert isinstance(error, stripe.APIError)
    assert error.http_status == 422
    assert error.error is not None
    assert error.error.code == "idempotency_key_reused"
    assert stripe_server.ledger.executions[key] == 1


async def test_a_replay_reaches_stripe_as_the_first_answer(
    stripe_client: stripe.StripeClient, stripe_server: LiveServer
) -> None:
    key = await paid_once(stripe_server, "stripe-replay", amount="3")
    call = functools.partial(
        stripe_client.raw_request, "post", "/payments", idempotency_key=key, amount="3"
    )
    response = await anyio.to_thread.run_sync(call)
    assert response.code == 201
    assert response.headers["x-idempotent-replay"] == "true"
    assert response.data == {"paymentId": f"p_{key}_1", "amount": "3"}


def test_400_invalid_key_is_stripes_invalid_request_error(
    stripe_client: stripe.StripeClient,
) -> None:
    with pytest.raises(stripe.InvalidRequestError) as raised:
        stripe_post(stripe_client, "/payments", "has space", amount="1")
    assert raised.value.http_status == 400
    assert raised.value.code == "idempotency_key_invalid"
