"""Prometheus multiprocess mode through real HTTP: two uvicorn workers, and ``/metrics`` from
either of them counts the requests both answered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from starlette_idempotency.testing._isolation import delete_prefixed_at, unique_prefix
from tests.support.uvicorn import UvicornServer

pytestmark = pytest.mark.e2e


def until_both_workers(
    call: Callable[[], httpx.Response], limit: int = 500
) -> list[httpx.Response]:
    """``call`` (each on a new connection) until two worker pids have answered."""
    responses: list[httpx.Response] = []
    while len({r.headers["x-worker-pid"] for r in responses}) < 2:
        assert len(responses) < limit, "one worker answered every request"
        responses.append(call())
    return responses


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def test_counters_are_summed_across_two_workers(redis_url: str, tmp_path: Path) -> None:
    prefix = unique_prefix()
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "IDEM_TEST_REDIS_URL": redis_url,
        "IDEM_TEST_PREFIX": prefix,
    }
    try:
        with UvicornServer("tests.e2e.apps.workers:app", env=env, workers=2) as server:
            sent = 0

            def pay() -> httpx.Response:
                nonlocal sent
                sent += 1
                headers = {"Idempotency-Key": f"k-{sent}"}
                response = httpx.post(f"{server.url}/pay", headers=headers, timeout=10)
                assert response.status_code == 201, response.text
                return response

            paid = until_both_workers(pay)
            replay = httpx.post(f"{server.url}/pay", headers={"Idempotency-Key": "k-1"})
            assert replay.headers["x-idempotent-replay"] == "true"

            scrapes = until_both_workers(lambda: httpx.get(f"{server.url}/metrics/", timeout=10))
    finally:
        asyncio.run(delete_prefixed_at(redis_url, prefix))
    endpoint = ("endpoint", "POST /pay")
    for scrape in scrapes:
        requests = samples(scrape.text, "idempotency_requests_total")
        assert requests[(endpoint, ("result", "ACQUIRED"))] == len(paid)
        assert requests[(endpoint, ("result", "REPLAYED"))] == 1
        assert requests[(endpoint, ("result", "CONFLICT"))] == 0  # created at zero
        outcomes = samples(scrape.text, "idempotency_outcomes_total")
        assert outcomes[(endpoint, ("result", "COMPLETED"))] == len(paid)
        assert samples(scrape.text, "idempotency_waiting_requests") == {(): 0.0}
        latency = samples(scrape.text, "idempotency_store_latency_seconds_count")
        assert latency[(("operation", "try_acquire"), ("store", "redis"))] == len(paid) + 1
