"""Metrics from the first second: every series a dashboard or an alert reads exists at zero
once the app has started, before any request, so a rate reads 0 rather than "no data" and the
first increase of a counter is seen by ``rate()`` and ``increase()``."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry
from starlette.types import Message

from starlette_idempotency import (
    IdempotencyEvent,
    IdempotencyMiddleware,
    MemoryStore,
    PrometheusMetrics,
    idempotent,
)
from starlette_idempotency._store_calls import OBSERVED_OPERATIONS
from starlette_idempotency.observability import (
    PROCESSING_TIMEOUT_REASONS,
    CheckResult,
    OutcomeResult,
)
from tests.support.conditions import eventually
from tests.support.prometheus import ALERTS, DASHBOARD

SRC = Path(__file__).resolve().parents[2] / "src" / "starlette_idempotency"
GUARDED = ("PATCH /members/{member_id}", "POST /payments")


def payments_app(metrics: Any, gate: asyncio.Event | None = None, **options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), metrics=metrics, **options)

    @app.post("/payments")
    @idempotent(on_in_progress="wait", wait_timeout_seconds=10)
    async def pay(request: Request) -> dict[str, str]:
        if gate is not None:
            await gate.wait()
        return {"paid": "yes"}

    @app.patch("/members/{member_id}")
    @idempotent()
    async def update(member_id: str, request: Request) -> dict[str, str]:
        return {"id": member_id}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/unguarded")
    async def unguarded() -> dict[str, str]:
        return {}

    return app


@contextlib.asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app started through its lifespan, as a server starts it, and a client to call it."""
    messages: asyncio.Queue[Message] = asyncio.Queue()
    sent: asyncio.Queue[Message] = asyncio.Queue()
    await messages.put({"type": "lifespan.startup"})
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    lifespan = asyncio.create_task(app(scope, messages.get, sent.put))
    assert (await sent.get())["type"] == "lifespan.startup.complete"
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    await messages.put({"type": "lifespan.shutdown"})
    assert (await sent.get())["type"] == "lifespan.shutdown.complete"
    await lifespan


def series(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for metric in registry.collect()
        for sample in metric.samples
        if not sample.name.endswith("_created")
    }


def expected_zeros() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every labelled series of the guarded endpoints and the memory store."""
    wanted: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for endpoint in GUARDED:
        for check in CheckResult:
            wanted.add(("idempotency_requests_total", (("endpoint", endpoint), ("result", check))))
        for outcome in OutcomeResult:
            wanted.add(
                ("idempotency_outcomes_total", (("endpoint", endpoint), ("result", outcome)))
            )
        wanted.add(("idempotency_conflict_total", (("endpoint", endpoint),)))
        for reason in PROCESSING_TIMEOUT_REASONS:
            wanted.add(
                (
                    "idempotency_processing_timeout_total",
                    (("endpoint", endpoint), ("reason", reason)),
                )
            )
    for operation in OBSERVED_OPERATIONS:
        labels = (("operation", operation), ("store", "memory"))
        wanted.add(("idempotency_store_errors_total", labels))
        wanted.add(("idempotency_store_latency_seconds_count", labels))
    wanted.add(("idempotency_waiting_requests", ()))
    return wanted


async def test_every_series_exists_at_zero_once_the_app_started() -> None:
    registry = CollectorRegistry()
    async with running(payments_app(PrometheusMetrics(registry=registry))):
        present = series(registry)  # the lifespan ran; no request yet
    missing = expected_zeros() - present.keys()
    assert not missing, sorted(missing)
    assert {present[name] for name in expected_zeros()} == {0.0}
    endpoints = {dict(labels).get("endpoint") for _, labels in present} - {None}
    assert endpoints == set(GUARDED)  # neither the GET nor the undecorated POST


async def test_without_a_lifespan_the_first_request_declares_them() -> None:
    registry = CollectorRegistry()
    app = payments_app(PrometheusMetrics(registry=registry))
    assert series(registry).keys() == {("idempotency_waiting_requests", ())}  # no labels
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/healthz")).status_code == 200
    assert expected_zeros() <= series(registry).keys()


def test_the_declared_reasons_are_those_the_engine_reports() -> None:
    reported = {
        reason
        for path in SRC.rglob("*.py")
        for found in re.findall(
            r"(?:lock_lost|processing_timeout)\(\s*\"(\w+)\"|^\w+_REASON = \"(\w+)\"",
            path.read_text(encoding="utf-8"),
            re.MULTILINE,
        )
        for reason in found
        if reason
    }
    assert reported == set(PROCESSING_TIMEOUT_REASONS)


async def test_waiting_duplicates_are_counted_while_they_wait() -> None:
    registry = CollectorRegistry()
    gate = asyncio.Event()
    app = payments_app(PrometheusMetrics(registry=registry), gate)
    transport = httpx.ASGITransport(app=app)

    def waiting() -> float | None:
        return registry.get_sample_value("idempotency_waiting_requests")

    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        headers = {"Idempotency-Key": "k"}
        first = asyncio.create_task(client.post("/payments", headers=headers))
        acquired = {"endpoint": "POST /payments", "result": "ACQUIRED"}
        await eventually(
            lambda: registry.get_sample_value("idempotency_requests_total", acquired) == 1
        )
        duplicates = [asyncio.create_task(client.post("/payments", headers=headers)) for _ in "ab"]
        await eventually(lambda: waiting() == 2, message="two duplicates to wait")
        gate.set()
        answers = await asyncio.gather(first, *duplicates)
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert waiting() == 0


class ThreeMethodSink:
    """A metrics sink of a user's, with the three required methods only."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def observe_event(self, event: IdempotencyEvent) -> None:
        self.events.append(event.result)

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        pass

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        pass


class FailingDeclareSink(ThreeMethodSink):
    def declare(self, endpoints: list[str], store: str) -> None:
        raise RuntimeError("declare broke")


async def test_a_sink_without_the_optional_methods_still_works() -> None:
    sink = ThreeMethodSink()
    gate = asyncio.Event()
    app = payments_app(sink, gate)
    async with running(app) as client:
        gate.set()
        response = await client.post("/payments", headers={"Idempotency-Key": "k"})
        assert response.status_code == 200
    assert sink.events == ["ACQUIRED", "COMPLETED"]


async def test_a_failing_declare_is_logged_and_never_stops_the_app(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(payments_app(FailingDeclareSink())) as client:
        assert (await client.get("/healthz")).status_code == 200
    assert any("declare() failed" in record.getMessage() for record in caplog.records)


def test_every_metric_the_dashboard_and_the_alerts_read_exists_at_startup() -> None:
    """What the monitoring kit reads is what an app that has only started already exports."""
    names = set(re.findall(r"\bidempotency_\w+", ALERTS.read_text() + DASHBOARD.read_text()))
    assert names
    registry = CollectorRegistry()

    async def started() -> set[str]:
        async with running(payments_app(PrometheusMetrics(registry=registry))):
            return {name for name, _ in series(registry)}

    exported = asyncio.run(started())
    assert names <= exported, names - exported
