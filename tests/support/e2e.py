"""The end-to-end tests' demo clusters (nginx, two uvicorn pods, Redis, PostgreSQL), request
bodies and ledger reads."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from examples.payments.cluster import CRASH_HOOKS, Cluster, StoreKind

# Short, so the crash scenario waits 2 s for the lock to lapse instead of 60 s.
LOCK_TTL_SECONDS = 2.0


class Clusters:
    """Starts one cluster per store on first use and stops them all at the end."""

    def __init__(self) -> None:
        self._running: dict[StoreKind, Cluster] = {}

    def get(self, store: StoreKind) -> Cluster:
        if store not in self._running:
            cluster = Cluster(
                store=store,
                payments_lock_ttl_seconds=LOCK_TTL_SECONDS,
                env={CRASH_HOOKS: "1"},  # X-Demo-Crash, for test_payment_transaction
            )
            cluster.start()  # stops what it started if it fails half-way
            self._running[store] = cluster
        cluster = self._running[store]
        cluster.heal()
        return cluster

    def close(self) -> None:
        errors = []
        for cluster in self._running.values():
            try:
                cluster.close()
            except Exception as exc:
                errors.append(exc)
        self._running.clear()
        if errors:
            raise errors[0]


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


async def first_payment(
    client: httpx.AsyncClient,
) -> tuple[dict[str, Any], str, httpx.Response]:
    """A new payment body and key, and the answer to their first request (a 200)."""
    body, key = payment_body(), new_key()
    first = await post(client, "/payments", body, key=key)
    assert first.status_code == 200
    return body, key, first


async def payment_rows(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    response = await client.get(f"{base_url}/payments", params={"merchantReference": reference})
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows


async def outbox_rows(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    response = await client.get(f"{base_url}/outbox", params={"merchantReference": reference})
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows


async def provider_charges(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    """What the demo's fake provider charged for a merchant reference."""
    response = await client.get(
        f"{base_url}/provider/charges", params={"merchantReference": reference}
    )
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows


async def order_rows(client: httpx.AsyncClient, base_url: str, reference: str) -> list[Any]:
    response = await client.get(f"{base_url}/orders", params={"orderReference": reference})
    response.raise_for_status()
    rows: list[Any] = response.json()
    return rows
