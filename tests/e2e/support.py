"""Helpers for the end-to-end tests: request bodies, ledger reads and condition polling."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

_T = TypeVar("_T")


def new_key(label: str = "k") -> str:
    return f"e2e-{label}-{uuid.uuid4().hex}"


def payment_body(amount: str = "25.50", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "accountId": "acc-e2e",
        "amount": amount,
        "currency": "EUR",
        "merchantReference": f"ref-{uuid.uuid4().hex}",
    }
    body.update(overrides)
    return body


async def post(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    key: str | None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    sent = dict(headers or {})
    if key is not None:
        sent["Idempotency-Key"] = key
    return await client.post(url, json=body, headers=sent)


async def payment_rows(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    response = await client.get(f"{base_url}/payments", params={"merchantReference": reference})
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows


async def order_rows(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    response = await client.get(f"{base_url}/orders", params={"orderReference": reference})
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows


async def eventually(
    probe: Callable[[], Awaitable[_T | None]],
    *,
    within: float,
    interval: float = 0.1,
    what: str,
) -> _T:
    """Poll ``probe`` until it returns something other than ``None``; fail after ``within``
    seconds."""
    deadline = time.monotonic() + within
    while True:
        result = await probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)
