"""A payments API with one idempotent endpoint: the app tested in docs/how-to/testing.md."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from starlette_idempotency import (
    IdempotencyMiddleware,
    IdempotencyStore,
    idempotency_context,
    idempotent,
)

#: Charges the customer through the payment provider: (idempotency key, amount) -> charge id.
Charge = Callable[[str, int], Awaitable[str]]


class Payment(BaseModel):
    amount: int


def create_app(store: IdempotencyStore, charge: Charge, **middleware_options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **middleware_options)

    @app.post("/payments", status_code=201)
    @idempotent()
    async def pay(payment: Payment, request: Request) -> dict[str, str]:
        key = idempotency_context(request).key
        return {"charge": await charge(key, payment.amount)}

    return app
