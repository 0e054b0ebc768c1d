"""Every decision and outcome is one event: logged, handed to the hook, counted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from starlette_idempotency import IdempotencyEvent, MemoryStore, PrometheusMetrics
from tests.support.broken_store import BrokenStore
from tests.support.guarded import GuardedApp, make_guarded_app

PAYMENT = {"amount": "10.00", "currency": "EUR"}


class Collected:
    def __init__(self) -> None:
        self.events: list[IdempotencyEvent] = []

    async def __call__(self, event: IdempotencyEvent) -> None:
        self.events.append(event)

    def results(self, kind: str) -> list[str]:
        return [event.result for event in self.events if event.event == kind]


async def observed(
    store: MemoryStore | None = None, **options: Any
) -> tuple[GuardedApp, Collected]:
    sink = Collected()
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    harness = await make_guarded_app(
        "fastapi", store, on_event=sink, metrics=metrics, pod_id="pod-test", **options
    )
    harness.registry = registry  # type: ignore[attr-defined]
    return harness, sink


def sample(harness: GuardedApp, name: str, **labels: str) -> float:
    value = harness.registry.get_sample_value(name, labels)  # type: ignore[attr-defined]
    return float(value or 0.0)


async def test_check_results_for_each_decision() -> None:
    harness, sink = await observed(max_body_bytes=64)
    client = harness.client
    await client.post("/payments", json=PAYMENT)  # MISSING_KEY
    await client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "a b"})  # INVALID_KEY
    await client.post("/echo", content=b"x" * 65, headers={"Idempotency-Key": "big"})  # TOO_LARGE
    await client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})  # ACQUIRED
    await client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})  # REPLAYED
    await client.post(
        "/payments", json={"amount": "1"}, headers={"Idempotency-Key": "k"}
    )  # MISMATCH
    first = asyncio.create_task(
        client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "c", "x-gate": "g"})
    )
    async with asyncio.timeout(5):
        await harness.ledger.entered_event("g").wait()
    await client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "c"})  # CONFLICT
    harness.ledger.gate("g").set()
    await first  # ACQUIRED
    assert sink.results("idempotency_check") == [
        "MISSING_KEY",
        "INVALID_KEY",
        "TOO_LARGE",
        "ACQUIRED",
        "REPLAYED",
        "MISMATCH",
        "ACQUIRED",
        "CONFLICT",
    ]
    assert sink.results("idempotency_outcome") == ["COMPLETED", "COMPLETED"]
    event = sink.events[3]
    assert event.as_dict() == {
        "event": "idempotency_check",
        "idempotency_key": "k",
        "endpoint": "POST /payments",
        "result": "ACQUIRED",
        "pod_id": "pod-test",
        "duration_ms": event.duration_ms,
        "status_code": None,
        "note": None,
    }
    assert (
        sample(harness, "idempotency_requests_total", endpoint="POST /payments", result="ACQUIRED")
        == 2
    )
    assert sample(harness, "idempotency_conflict_total", endpoint="POST /payments") == 1
    assert (
        sample(harness, "idempotency_outcomes_total", endpoint="POST /payments", result="COMPLETED")
        == 2
    )
    assert (
        sample(
            harness,
            "idempotency_store_latency_seconds_count",
            store="memory",
            operation="try_acquire",
        )
        == 5
    )


async def test_outcome_results() -> None:
    harness, sink = await observed()
    client = harness.client
    await client.post("/status/404", headers={"Idempotency-Key": "f"})
    await client.post("/status/500", headers={"Idempotency-Key": "r"})
    with pytest.raises(RuntimeError, match="handler crashed"):
        await client.post("/crash", headers={"Idempotency-Key": "x"})
    outcomes = [(e.result, e.status_code) for e in sink.events if e.event == "idempotency_outcome"]
    assert outcomes == [("FAILED", 404), ("RELEASED", 500), ("RELEASED", None)]


async def test_lock_lost_is_an_outcome_and_a_processing_timeout() -> None:
    harness, sink = await observed()
    client, ledger = harness.client, harness.ledger
    first = asyncio.create_task(
        client.post("/short-lock", json={}, headers={"Idempotency-Key": "k", "x-gate": "a"})
    )
    async with asyncio.timeout(5):
        await ledger.entered_event("a").wait()
    harness.clock.advance(5.1)
    second = asyncio.create_task(
        client.post("/short-lock", json={}, headers={"Idempotency-Key": "k", "x-gate": "b"})
    )
    async with asyncio.timeout(5):
        await ledger.entered_event("b").wait()
    ledger.gate("a").set()
    await first
    ledger.gate("b").set()
    await second
    assert sink.results("idempotency_outcome") == ["LOCK_LOST", "COMPLETED"]
    endpoint = "POST /short-lock"
    assert (
        sample(
            harness, "idempotency_processing_timeout_total", endpoint=endpoint, reason="lock_lost"
        )
        == 1
    )
    assert (
        sample(
            harness,
            "idempotency_processing_timeout_total",
            endpoint=endpoint,
            reason="expired_lease_taken_over",
        )
        == 1
    )


@pytest.mark.parametrize(
    ("policy", "result"), [("fail_closed", "STORE_ERROR"), ("fail_open", "FAIL_OPEN")]
)
async def test_store_errors_are_counted(policy: str, result: str) -> None:
    harness, sink = await observed(BrokenStore(failing={"try_acquire"}), on_store_error=policy)
    await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})
    assert sink.results("idempotency_check") == [result]
    assert (
        sample(harness, "idempotency_store_errors_total", store="memory", operation="try_acquire")
        == 1
    )


async def test_events_are_logged_with_extra_fields(caplog: pytest.LogCaptureFixture) -> None:
    harness = await make_guarded_app("fastapi", pod_id="pod-a", log_keys="hashed")
    with caplog.at_level(logging.INFO, logger="starlette_idempotency"):
        await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "secret"})
    checks = [r for r in caplog.records if getattr(r, "event", None) == "idempotency_check"]
    assert len(checks) == 1
    record: Any = checks[0]
    assert record.name == "starlette_idempotency"
    assert record.result == "ACQUIRED"
    assert record.pod_id == "pod-a"
    assert record.endpoint == "POST /payments"
    assert record.idempotency_key.startswith("sha256:")
    assert "secret" not in record.idempotency_key


async def test_a_failing_hook_never_fails_the_request(caplog: pytest.LogCaptureFixture) -> None:
    def broken_hook(event: IdempotencyEvent) -> None:
        raise RuntimeError("sink down")

    harness = await make_guarded_app("fastapi", on_event=broken_hook)
    with caplog.at_level(logging.ERROR, logger="starlette_idempotency"):
        response = await harness.client.post(
            "/payments", json=PAYMENT, headers={"Idempotency-Key": "k"}
        )
    assert response.status_code == 201
    assert any("on_event hook failed" in r.getMessage() for r in caplog.records)


def test_two_apps_in_one_process_use_their_own_registries() -> None:
    PrometheusMetrics(registry=CollectorRegistry())
    PrometheusMetrics(registry=CollectorRegistry())


async def test_store_calls_are_traced_with_opentelemetry() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    harness = await make_guarded_app("fastapi", tracing=True)
    await harness.client.post("/payments", json=PAYMENT, headers={"Idempotency-Key": "k"})
    spans = exporter.get_finished_spans()
    names = [span.name for span in spans if span.name.startswith("idempotency.")]
    assert names == ["idempotency.store.try_acquire", "idempotency.store.complete"]


async def test_renewal_that_finds_the_lock_gone_is_a_processing_timeout() -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from starlette_idempotency import IdempotencyMiddleware, idempotent
    from tests.support.conditions import eventually
    from tests.support.guarded import make_client

    registry = CollectorRegistry()
    store = MemoryStore()
    release = asyncio.Event()

    @idempotent(lock_ttl_seconds=0.3)
    async def slow(request: Request) -> Response:
        await release.wait()
        return JSONResponse({})

    app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])
    middleware = IdempotencyMiddleware(
        app, store=store, metrics=PrometheusMetrics(registry=registry)
    )
    request = asyncio.create_task(
        make_client(middleware).post("/slow", headers={"Idempotency-Key": "k"})
    )
    await eventually(lambda: len(store) == 1)
    await store.aclose()  # the lock vanishes (a flush, a failover) while the handler runs

    def counted() -> bool:
        value = registry.get_sample_value(
            "idempotency_processing_timeout_total",
            {"endpoint": "POST /slow", "reason": "renewal_found_gone"},
        )
        return value == 1

    await eventually(counted, message="the renewal to find the lock gone")
    release.set()
    assert (await request).status_code == 200


class FailingSink:
    """A metrics sink whose backend is down: every call raises."""

    def __init__(self) -> None:
        self.calls = 0

    def _fail(self) -> None:
        self.calls += 1
        raise RuntimeError("metrics backend down")

    def observe_event(self, event: IdempotencyEvent) -> None:
        self._fail()

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        self._fail()

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        self._fail()


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.finishes = 0

    async def finish(self, key: str, record: Any, ttl: float) -> Any:
        self.finishes += 1
        return await super().finish(key, record, ttl)


async def test_a_metrics_sink_that_raises_fails_no_request_and_no_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its failure after the outcome's write (timing it) wrote the outcome a second time and
    answered the client 500 while retries were replayed."""
    sink, store = FailingSink(), CountingStore()
    harness = await make_guarded_app("fastapi", store, metrics=sink)
    headers = {"Idempotency-Key": "k"}
    with caplog.at_level(logging.ERROR, logger="starlette_idempotency"):
        first = await harness.client.post("/payments", json=PAYMENT, headers=headers)
        again = await harness.client.post("/payments", json=PAYMENT, headers=headers)
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.headers["x-idempotent-replay"] == "true"
    assert store.finishes == 1
    assert harness.ledger.executions["payments"] == 1
    assert sink.calls > 0
    assert caplog.text.count("the metrics sink's observe_store_call() failed") == 1  # once
