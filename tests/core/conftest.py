from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp

from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from starlette_idempotency.testing import FakeClock
from tests.core.apps import Ledger, build_fastapi_app, build_starlette_app

BUILDERS: dict[str, Callable[[Ledger], Any]] = {
    "fastapi": build_fastapi_app,
    "starlette": build_starlette_app,
}


@dataclass
class Harness:
    ledger: Ledger
    store: MemoryStore
    clock: FakeClock
    client: httpx.AsyncClient
    app: Any


def make_client(app: ASGIApp) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


@pytest.fixture(params=sorted(BUILDERS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def harness(kind: str) -> Harness:
    return await make_harness(kind)


async def make_harness(kind: str, store: MemoryStore | None = None, **options: Any) -> Harness:
    ledger = Ledger()
    clock = FakeClock()
    store = MemoryStore(clock=clock) if store is None else store
    app = BUILDERS[kind](ledger)
    app.add_middleware(IdempotencyMiddleware, store=store, clock=clock, **options)
    return Harness(ledger, store, clock, make_client(app), app)
