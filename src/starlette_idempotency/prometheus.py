"""Prometheus metrics for the middleware (``pip install starlette-idempotency[prometheus]``).

Pass your own ``registry`` when two apps share a process, so their metrics do not collide on
the default one. Every series exists at zero from the app's startup (the middleware declares its
guarded endpoints and its store then), so a rate reads 0 rather than "no data" and the first
increase of a counter is seen by ``rate()`` and ``increase()``.

Serve them with :func:`metrics_app`: under ``uvicorn --workers N`` or gunicorn, with
``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client's multiprocess mode), it serves the sum over
every worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from starlette_idempotency._store_calls import OBSERVED_OPERATIONS
from starlette_idempotency.observability import (
    PROCESSING_TIMEOUT_REASONS,
    CheckResult,
    IdempotencyEvent,
    OutcomeResult,
)

try:
    import prometheus_client
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "PrometheusMetrics needs prometheus-client: pip install 'starlette-idempotency[prometheus]'"
    ) from exc


class PrometheusMetrics:
    """Counters and a latency histogram, registered on ``registry`` (default: the global one).

    - ``idempotency_requests_total{endpoint,result}``: every check decision.
    - ``idempotency_outcomes_total{endpoint,result}``: how acquired requests ended.
    - ``idempotency_conflict_total{endpoint}``: 409s, a duplicate arrived while the first ran.
    - ``idempotency_processing_timeout_total{endpoint,reason}``: locks that ran out.
    - ``idempotency_store_errors_total{store,operation}``: failed or timed-out store calls.
    - ``idempotency_store_latency_seconds{store,operation}``: store call latency.
    - ``idempotency_waiting_requests``: duplicates waiting for a first request now
      (``on_in_progress="wait"``).
    """

    def __init__(self, registry: Any = None, *, namespace: str = "") -> None:
        registry = prometheus_client.REGISTRY if registry is None else registry
        common: dict[str, Any] = {"namespace": namespace, "registry": registry}
        self.requests = prometheus_client.Counter(
            "idempotency_requests",
            "Guarded requests by endpoint and decision.",
            ["endpoint", "result"],
            **common,
        )
        self.outcomes = prometheus_client.Counter(
            "idempotency_outcomes",
            "Requests that acquired their key, by how they ended.",
            ["endpoint", "result"],
            **common,
        )
        self.conflicts = prometheus_client.Counter(
            "idempotency_conflict",
            "Duplicates answered 409 because the first request was still running.",
            ["endpoint"],
            **common,
        )
        self.processing_timeouts = prometheus_client.Counter(
            "idempotency_processing_timeout",
            "Locks that ran out: lost to a takeover, gone on renewal, or an expired lease taken.",
            ["endpoint", "reason"],
            **common,
        )
        self.store_errors = prometheus_client.Counter(
            "idempotency_store_errors",
            "Store calls that failed or timed out.",
            ["store", "operation"],
            **common,
        )
        self.store_latency = prometheus_client.Histogram(
            "idempotency_store_latency_seconds",
            "Latency of store calls.",
            ["store", "operation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            **common,
        )
        self.waiting = prometheus_client.Gauge(
            "idempotency_waiting_requests",
            "Duplicates waiting for the first request to finish (on_in_progress='wait').",
            # With several workers: the sum over the live ones (ignored in a single process).
            multiprocess_mode="livesum",
            **common,
        )

    def declare(self, endpoints: Iterable[str], store: str) -> None:
        """Create every series of ``endpoints`` and ``store`` at zero (the middleware calls it
        once it knows its routes: at startup, or at the first request without a lifespan)."""
        for endpoint in endpoints:
            for check in CheckResult:
                self.requests.labels(endpoint, check.value)
            for outcome in OutcomeResult:
                self.outcomes.labels(endpoint, outcome.value)
            self.conflicts.labels(endpoint)
            for reason in PROCESSING_TIMEOUT_REASONS:
                self.processing_timeouts.labels(endpoint, reason)
        for operation in OBSERVED_OPERATIONS:
            self.store_latency.labels(store, operation)
            self.store_errors.labels(store, operation)

    def observe_event(self, event: IdempotencyEvent) -> None:
        if event.event == "idempotency_check":
            self.requests.labels(event.endpoint, event.result).inc()
            if event.result == "CONFLICT":
                self.conflicts.labels(event.endpoint).inc()
        else:
            self.outcomes.labels(event.endpoint, event.result).inc()

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        self.store_latency.labels(store, operation).observe(seconds)
        if not ok:
            self.store_errors.labels(store, operation).inc()

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        self.processing_timeouts.labels(endpoint, reason).inc()

    def observe_waiting(self, delta: int) -> None:
        self.waiting.inc(delta)


def metrics_app(registry: Any = None) -> Callable[..., Any]:
    """An ASGI app serving the Prometheus metrics (mount it: ``app.mount("/metrics", ...)``).

    With ``PROMETHEUS_MULTIPROC_DIR`` set (several worker processes: ``uvicorn --workers N``,
    gunicorn), whichever worker answers serves the sum over every worker, read from that
    directory by prometheus_client's ``MultiProcessCollector``: the metrics of the app's
    ``registry`` and of any other registry alike. Otherwise it serves ``registry`` (default:
    the global one), this process's metrics, as ``prometheus_client.make_asgi_app`` does.
    """
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    elif registry is None:
        registry = prometheus_client.REGISTRY
    app: Callable[..., Any] = prometheus_client.make_asgi_app(registry=registry)
    return app
