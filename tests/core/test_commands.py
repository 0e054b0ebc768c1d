"""fingerprint="validated": the command is hashed, not the bytes; invalid bodies skip the store."""

from __future__ import annotations

import uuid
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from starlette_idempotency import (
    AcquireResult,
    IdempotencyMiddleware,
    IdempotencyRecord,
    MemoryStore,
    idempotent,
)
from tests.core.conftest import make_client


class Line(BaseModel):
    sku: str
    quantity: int = 1


class Order(BaseModel):
    amount: float
    price: Decimal = Decimal("0")
    currency: str = "EUR"
    lines: list[Line] = []
    reference: str = Field(default_factory=lambda: uuid.uuid4().hex)
    client_timestamp: int | None = Field(default=None, alias="clientTimestamp")


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.calls["try_acquire"] += 1
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)


def build(**options: Any) -> tuple[FastAPI, Counter[str], CountingStore]:
    runs: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/orders/{shop}")
    @idempotent(fingerprint="validated", exclude_fields=["clientTimestamp"], **options)
    async def create(shop: int, order: Order) -> dict[str, int]:
        runs["orders"] += 1
        return {"n": runs["orders"]}

    store = CountingStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app, runs, store


async def send_twice(first: dict[str, Any], second: dict[str, Any], path: str = "/orders/1") -> int:
    app, runs, _ = build()
    client = make_client(app)
    headers = {"Idempotency-Key": "k"}
    assert (await client.post("/orders/1", json=first, headers=headers)).status_code == 200
    again = await client.post(path, json=second, headers=headers)
    return again.status_code if again.status_code != 200 else runs["orders"]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"amount": 10}, {"amount": 10.0}),
        ({"amount": 10}, {"amount": "10"}),
        ({"amount": 1}, {"amount": 1, "currency": "EUR"}),
        ({"amount": 1}, {"amount": 1, "lines": []}),
        (
            {"amount": 1, "lines": [{"sku": "a"}]},
            {"amount": 1, "lines": [{"sku": "a", "quantity": 1}]},
        ),
        ({"amount": 1, "price": "10"}, {"amount": 1, "price": "10.00"}),
        ({"amount": 1, "clientTimestamp": 1}, {"amount": 1, "clientTimestamp": 2}),
        ({"amount": 1, "reference": "r"}, {"reference": "r", "amount": 1}),
    ],
)
async def test_equal_commands_replay(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert await send_twice(first, second) == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"amount": 10}, {"amount": 11}),
        ({"amount": 1}, {"amount": 1, "currency": "USD"}),
        ({"amount": 1, "reference": "r"}, {"amount": 1, "reference": "s"}),
        ({"amount": 1}, {"amount": 1, "reference": "s"}),  # a factory default sent only once
    ],
)
async def test_different_commands_are_a_mismatch(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    assert await send_twice(first, second) == 422


async def test_path_parameters_take_part() -> None:
    assert await send_twice({"amount": 1}, {"amount": 1}, path="/orders/2") == 422


async def test_invalid_body_gets_fastapis_422_without_a_store_call() -> None:
    app, runs, store = build()
    client = make_client(app)
    for body in ({"amount": "lots"}, {}):
        response = await client.post("/orders/1", json=body, headers={"Idempotency-Key": "k"})
        assert response.status_code == 422
        assert "detail" in response.json()  # FastAPI's own answer
    invalid_json = await client.post(
        "/orders/1",
        content=b"{nope",
        headers={"Idempotency-Key": "k", "content-type": "application/json"},
    )
    assert invalid_json.status_code == 422
    assert store.calls["try_acquire"] == 0
    assert runs["orders"] == 0


async def test_records_carry_the_fingerprint_version() -> None:
    app, _, store = build(fingerprint_version="7")
    await make_client(app).post("/orders/1", json={"amount": 1}, headers={"Idempotency-Key": "k"})
    (record,) = [record for record, _ in store._entries.values()]
    assert record.fingerprint_version == "1.validated.7"


async def test_what_the_app_parses_is_parsed_alike() -> None:
    """NaN and integers past 64 bits are JSON to Starlette; they must be commands here too."""
    app, runs, store = build()
    client = make_client(app)
    headers = {"Idempotency-Key": "k", "content-type": "application/json"}
    for _ in range(2):
        response = await client.post("/orders/1", content=b'{"amount": 1e400}', headers=headers)
        assert response.status_code == 200
    assert runs["orders"] == 1
    assert store.calls["try_acquire"] == 2


async def test_endpoint_never_runs_unprotected() -> None:
    from starlette_idempotency.policy import (
        RequestMarks,
        UnprotectedEndpointError,
        current_marks,
    )

    calls: list[int] = []

    @idempotent()
    async def endpoint() -> None:
        calls.append(1)

    marks = RequestMarks()
    marks.must_not_start = True
    token = current_marks.set(marks)
    try:
        with pytest.raises(UnprotectedEndpointError):
            await endpoint()
    finally:
        current_marks.reset(token)
    assert calls == []
