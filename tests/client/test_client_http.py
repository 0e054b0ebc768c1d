"""The client transports against the real middleware over real HTTP (uvicorn on loopback).

Each scenario ends with the side effect run exactly once and the client holding the right
answer: 503s before the side effect, a reply lost after the response was stored, and a
request still in progress (409 with ``Retry-After``) that is waited out.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from starlette_idempotency.client import AsyncIdempotentTransport, IdempotentTransport
from tests.support.live_server import KEY_HEADER, LiveServer, plain_post

REPLAY = "X-Idempotent-Replay"


@dataclass
class Poster:
    """POSTs through an IdempotentTransport (in a worker thread) or an AsyncIdempotentTransport,
    sleeping for real but recording every wait it was asked for."""

    mode: str
    base_url: str
    options: dict[str, Any] = field(default_factory=dict)
    timeout: httpx.Timeout = field(default_factory=lambda: httpx.Timeout(5.0))
    sleeps: list[float] = field(default_factory=list)
    on_sleep: Callable[[float], None] | None = None

    def _record(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if self.on_sleep is not None:
            self.on_sleep(seconds)

    def _sleep(self, seconds: float) -> None:
        self._record(seconds)
        time.sleep(seconds)

    async def _async_sleep(self, seconds: float) -> None:
        self._record(seconds)
        await anyio.sleep(seconds)

    def _options(self) -> dict[str, Any]:
        return {"backoff_base": 0.01, "backoff_cap": 2.0, **self.options}

    def _post_sync(self, path: str, kwargs: dict[str, Any]) -> httpx.Response:
        transport = IdempotentTransport(sleep=self._sleep, **self._options())
        with httpx.Client(
            transport=transport, base_url=self.base_url, timeout=self.timeout
        ) as client:
            return client.post(path, **kwargs)

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        if self.mode == "sync":
            call = functools.partial(self._post_sync, path, kwargs)
            return await anyio.to_thread.run_sync(call)
        transport = AsyncIdempotentTransport(sleep=self._async_sleep, **self._options())
        async with httpx.AsyncClient(
            transport=transport, base_url=self.base_url, timeout=self.timeout
        ) as client:
            return await client.post(path, **kwargs)


@pytest.fixture(params=["sync", "async"])
def poster(request: pytest.FixtureRequest, live_server: LiveServer) -> Poster:
    return Poster(mode=str(request.param), base_url=live_server.base_url)


def new_key(label: str) -> str:
    return f"{label}-{uuid.uuid4()}"


def assert_replayed_after_one_run(
    response: httpx.Response, live_server: LiveServer, amount: str
) -> None:
    """The payment ran once, its reply was lost, and the retry got the stored answer."""
    key = response.request.headers[KEY_HEADER]
    assert response.status_code == 201
    assert response.headers[REPLAY] == "true"
    assert response.json() == {"paymentId": f"p_{key}_1", "amount": amount}
    assert live_server.ledger.requests[key] == 2
    assert live_server.ledger.executions[key] == 1


async def test_503s_before_the_side_effect_are_retried(
    poster: Poster, live_server: LiveServer
) -> None:
    ledger = live_server.ledger
    response = await poster.post("/flaky", json={"amount": "10.00"}, headers={"x-fail-times": "2"})
    key = response.request.headers[KEY_HEADER]
    assert response.status_code == 201
    assert REPLAY not in response.headers
    assert response.json() == {"paymentId": f"p_{key}_1", "amount": "10.00"}
    assert ledger.requests[key] == 3
    assert ledger.handler_calls[key] == 3
    assert ledger.executions[key] == 1
    assert len(poster.sleeps) == 2


async def test_503s_past_max_attempts_come_back(poster: Poster, live_server: LiveServer) -> None:
    poster.options["max_attempts"] = 3
    response = await poster.post("/flaky", json={"amount": "1"}, headers={"x-fail-times": "9"})
    key = response.request.headers[KEY_HEADER]
    assert response.status_code == 503
    assert live_server.ledger.requests[key] == 3
    assert live_server.ledger.executions[key] == 0


async def test_without_the_transport_a_dropped_reply_is_lost(live_server: LiveServer) -> None:
    key = new_key("plain-drop")
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await plain_post(
            live_server.base_url,
            "/payments",
            key,
            json={"amount": "5.00"},
            headers={"x-fault": "drop"},
        )
    assert live_server.ledger.executions[key] == 1


async def test_a_reply_dropped_after_the_headers_is_replayed(
    poster: Poster, live_server: LiveServer
) -> None:
    response = await poster.post("/payments", json={"amount": "5.00"}, headers={"x-fault": "drop"})
    assert_replayed_after_one_run(response, live_server, "5.00")


async def test_a_withheld_reply_times_out_and_is_replayed(
    poster: Poster, live_server: LiveServer
) -> None:
    poster.timeout = httpx.Timeout(5.0, read=0.5)
    response = await poster.post(
        "/payments", json={"amount": "6.00"}, headers={"x-fault": "withhold"}
    )
    assert_replayed_after_one_run(response, live_server, "6.00")


async def test_in_progress_is_waited_out(poster: Poster, live_server: LiveServer) -> None:
    ledger = live_server.ledger
    key = new_key("held")
    entered, release = ledger.events(key)
    body = {"amount": "7.00"}
    firsts: list[httpx.Response] = []

    async def first_request() -> None:
        firsts.append(await plain_post(live_server.base_url, "/held", key, json=body))

    # The first request stays in the handler until the second one is told to wait.
    poster.on_sleep = lambda seconds: release.set()
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(first_request)
            assert await anyio.to_thread.run_sync(entered.wait, 5.0)
            second = await poster.post("/held", json=body, headers={KEY_HEADER: key})
    finally:
        release.set()
    (first,) = firsts
    assert first.status_code == 201
    assert REPLAY not in first.headers
    assert second.status_code == 201
    assert second.headers[REPLAY] == "true"
    assert second.json() == first.json() == {"paymentId": f"p_{key}_1", "amount": "7.00"}
    assert poster.sleeps[0] == 1.0  # the server's Retry-After, not the 0.01 s backoff
    assert ledger.handler_calls[key] == 1
    assert ledger.executions[key] == 1
    assert ledger.requests[key] == 2 + len(poster.sleeps)


async def test_a_key_reused_with_another_body_is_not_retried(
    poster: Poster, live_server: LiveServer
) -> None:
    key = new_key("reused")
    first = await plain_post(live_server.base_url, "/payments", key, json={"amount": "1"})
    assert first.status_code == 201
    response = await poster.post("/payments", json={"amount": "2"}, headers={KEY_HEADER: key})
    assert response.status_code == 422
    assert live_server.ledger.requests[key] == 2
    assert live_server.ledger.executions[key] == 1
    assert poster.sleeps == []
