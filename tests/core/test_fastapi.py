"""FastAPI specifics: the endpoint-start mark, signature and OpenAPI, the decorator order."""

from __future__ import annotations

import inspect

import httpx
import pytest
from fastapi import FastAPI

from starlette_idempotency import ConfigurationError, IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_guarded_app

PAYMENT = {"amount": "10.00", "currency": "EUR"}


async def test_request_validation_422_releases_the_key() -> None:
    harness = await make_guarded_app("fastapi")
    invalid = await harness.client.post(
        "/payments", json={"amount": None}, headers={"Idempotency-Key": "k"}
    )
    assert invalid.status_code == 422
    assert "detail" in invalid.json()
    assert len(harness.store) == 0
    fixed = await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert fixed.status_code == 201
    assert harness.ledger.executions["payments"] == 1


async def test_auth_dependency_401_releases_the_key() -> None:
    harness = await make_guarded_app("fastapi")
    denied = await harness.client.post("/secured", json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert denied.status_code == 401
    allowed = await harness.client.post(
        "/secured", json=PAYMENT, headers={"Idempotency-Key": "k", "Authorization": "Bearer ok"}
    )
    assert allowed.status_code == 200
    assert harness.ledger.executions["secured"] == 1


async def test_handler_422_is_a_stored_business_failure() -> None:
    harness = await make_guarded_app("fastapi")
    for _ in range(2):
        response = await harness.client.post("/handler-422", headers={"Idempotency-Key": "k"})
        assert response.status_code == 422
    assert response.headers["x-idempotent-replay"] == "true"
    assert harness.ledger.executions["handler-422"] == 1


async def test_reverse_decorator_order_is_refused_with_the_right_order_shown() -> None:
    app = FastAPI()

    @idempotent()
    @app.post("/reverse")
    async def reverse(body: dict[str, int]) -> dict[str, int]:
        return body

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with pytest.raises(ConfigurationError) as refused:
            await client.post("/reverse", json={"a": 1}, headers={"Idempotency-Key": "k"})
    assert "@idempotent is above the route decorator on /reverse" in str(refused.value)
    assert '@app.post("/reverse")\n    @idempotent(...)' in str(refused.value)


async def test_sync_endpoint_in_a_thread_reports_its_start() -> None:
    harness = await make_guarded_app("fastapi")
    first = await harness.client.patch("/optional", headers={"Idempotency-Key": "k"})
    replay = await harness.client.patch("/optional", headers={"Idempotency-Key": "k"})
    assert first.json() == replay.json()
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_signature_and_openapi_are_unchanged() -> None:
    harness = await make_guarded_app("fastapi")
    route = next(r for r in harness.app.routes if getattr(r, "path", "") == "/payments")
    parameters = inspect.signature(route.endpoint).parameters
    assert list(parameters) == ["body", "request"]
    schema = (await harness.client.get("/openapi.json")).json()
    operation = schema["paths"]["/payments"]["post"]
    assert operation["operationId"].startswith("payments")
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Payment"
    }
