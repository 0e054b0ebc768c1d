"""Two hosts serving one path through real uvicorn, in both orders: the guarded one runs once
for a retried key and demands a key; the open one answers every request, with or without one.

A fresh server for each order: which host comes first is what a lookup cache keyed on the path
alone would remember.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.support.uvicorn import UvicornServer

pytestmark = pytest.mark.e2e


@pytest.fixture
def server() -> Iterator[UvicornServer]:
    with UvicornServer("tests.e2e.apps.host_routing:app") as running:
        yield running


async def post_orders(client: httpx.AsyncClient, host: str, key: str | None) -> httpx.Response:
    headers = {"Host": host} if key is None else {"Host": host, "Idempotency-Key": key}
    return await client.post("/orders", json={"item": 1}, headers=headers)


async def check_guarded(client: httpx.AsyncClient) -> None:
    key = uuid.uuid4().hex
    first = await post_orders(client, "api.example", key)
    retry = await post_orders(client, "api.example", key)
    assert first.status_code == 201, first.text
    assert retry.status_code == 201
    assert retry.headers.get("x-idempotent-replay") == "true"
    assert retry.json() == first.json()
    assert (await post_orders(client, "api.example", None)).status_code == 400


async def check_open(client: httpx.AsyncClient) -> None:
    key = uuid.uuid4().hex
    for sent_key in (None, key, key):
        response = await post_orders(client, "admin.example", sent_key)
        assert response.status_code == 201, response.text
        assert "x-idempotent-replay" not in response.headers


@pytest.mark.parametrize("api_first", [True, False], ids=["api-first", "admin-first"])
async def test_two_hosts_one_path(server: UvicornServer, api_first: bool) -> None:
    checks = [check_guarded, check_open]
    async with httpx.AsyncClient(base_url=server.url, timeout=10.0) as client:
        for check in checks if api_first else checks[::-1]:
            await check(client)
        runs = (await client.get("/runs")).json()
    assert runs == {"api": 1, "admin": 3}
