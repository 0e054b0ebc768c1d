"""A guarded request leaves no reference cycles behind: what it allocates is freed by reference
counting, not by the garbage collector (whose full collections stall every request in flight).
Measured against the bare app, whose own framework may leave some, in a process of its own:
in the test run's, whatever an earlier test leaves for the collector would be counted too."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from starlette_idempotency._types import Message
from tests.support.asgi import payments_scope

BODY = b'{"accountId":"acc_1","amount":10.5,"currency":"EUR","merchantReference":"r-1"}'
ROUNDS = 200


class Payment(BaseModel):
    accountId: str
    amount: float
    currency: str
    merchantReference: str


def payments_app(guarded: bool) -> FastAPI:
    app = FastAPI()

    @app.post("/payments")
    async def pay(payment: Payment) -> dict[str, object]:
        return {"id": "p_1", "amount": payment.amount, "status": "ok"}

    if guarded:
        app.add_middleware(
            IdempotencyMiddleware, store=MemoryStore(), protect_all=True, key_scope=lambda _: "u"
        )
    return app


async def post(app: FastAPI, key: str) -> int:
    scope = payments_scope((b"idempotency-key", key.encode()))
    messages = iter([{"type": "http.request", "body": BODY, "more_body": False}])
    status = 0

    async def receive() -> Message:
        return next(messages, {"type": "http.disconnect"})

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def cyclic_objects_per_request(app: FastAPI, keys: list[str]) -> float:
    for key in keys[:20]:  # warm up: first requests fill caches
        await post(app, key)
    gc.collect()
    gc.garbage.clear()
    for key in keys:
        assert await post(app, key) == 200
    await asyncio.sleep(0)
    gc.collect()
    return len(gc.garbage) / len(keys)


async def measure(path: str) -> dict[str, float]:
    """Cyclic objects per request, guarded and bare (run in the child process)."""
    keys = [str(uuid.uuid4()) for _ in range(ROUNDS)] if path == "first request" else ["k"] * ROUNDS
    # Both built first: an app freed meanwhile (apps are cyclic) would count as garbage.
    bare_app, guarded_app = payments_app(guarded=False), payments_app(guarded=True)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    return {
        "bare": await cyclic_objects_per_request(bare_app, keys),
        "guarded": await cyclic_objects_per_request(guarded_app, keys),
    }


CHILD = "import asyncio, json, sys; from tests.core.test_reference_cycles import measure; "
CHILD += "print(json.dumps(asyncio.run(measure(sys.argv[1]))))"


@pytest.mark.parametrize("path", ["first request", "replay"])
def test_a_guarded_request_leaves_no_more_cycles_than_the_bare_app(path: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert child.returncode == 0, child.stderr
    counted = json.loads(child.stdout.splitlines()[-1])
    bare, guarded = counted["bare"], counted["guarded"]

    assert guarded <= bare, f"{guarded} cyclic objects per request, the bare app {bare}"
