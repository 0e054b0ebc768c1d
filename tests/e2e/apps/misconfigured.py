"""Apps whose IdempotencyMiddleware is misconfigured, as users write them for ``uvicorn
main:app``: the middleware's options are only read when Starlette builds the stack, at the
lifespan's start. ``$IDEM_TEST_MISCONFIGURED`` picks the mistake."""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent

MISTAKES: dict[str, dict[str, Any]] = {
    "typo": {"store": MemoryStore(), "on_store_eror": "fail_open"},
    "url": {"store": "redis://localhost:6379/0"},
    "no store": {},  # the one mistake __init__ could not even bind
    "none": {"store": MemoryStore()},
}

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware, **MISTAKES[os.environ.get("IDEM_TEST_MISCONFIGURED", "typo")]
)


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/payments")
@idempotent()
async def pay() -> dict[str, str]:
    return {"paid": "yes"}
