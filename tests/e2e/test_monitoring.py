"""The monitoring kit against the real thing: a Prometheus (Debian's package) scrapes the demo's
two pods, with the alerting rules loaded, through a short load; every dashboard panel's query
then returns data, the panels of what the load did show it, and a Redis outage makes one page
pending."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from examples.payments.cluster import Cluster

from tests.support.conditions import eventually
from tests.support.e2e import new_key, payment_body, post
from tests.support.prometheus import ALERTS, DASHBOARD, Prometheus, panel_queries, promtool

pytestmark = pytest.mark.e2e

JOB = "payments"
#: Requests sent while Redis is down: well over a tenth of the load's store calls fail.
OUTAGE_REQUESTS = 20
#: Grafana's variables, as the dashboard is shown for the demo's job.
VARIABLES = {"$job": JOB, "$__rate_interval": "1m"}


def as_grafana_sends(query: str) -> str:
    for variable, value in VARIABLES.items():
        query = query.replace(variable, value)
    assert "$" not in query, query
    return query


@pytest.fixture
def prometheus(redis_cluster: Cluster) -> Iterator[Prometheus]:
    targets = [f"127.0.0.1:{pod.port}" for pod in redis_cluster.pods.values()]
    with Prometheus(targets, job=JOB, metrics_path="/metrics/", rule_files=[ALERTS]) as server:
        yield server


def values(result: list[dict[str, Any]]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


def above_zero(prometheus: Prometheus, query: str) -> bool:
    return any(value > 0 for value in values(prometheus.query(query)))


async def load(cluster: Cluster) -> None:
    """A short load through nginx: new payments, their retries, a key reused for another
    payment, duplicates of a slow payment, and a Redis outage of some requests."""
    pods = list(cluster.pods.values())
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as client:
        for _ in range(10):
            body, key = payment_body(), new_key("load")
            assert (await post(client, "/payments", body, key=key)).status_code == 200
            assert (await post(client, "/payments", body, key=key)).status_code == 200
            other = payment_body(amount="99.99")
            assert (await post(client, "/payments", other, key=key)).status_code == 422

        body, key = payment_body(), new_key("slow")
        slow = asyncio.create_task(
            post(client, "/payments", body, key=key, headers={"X-Demo-Delay-Ms": "1500"})
        )

        reference = body["merchantReference"]

        async def sleeping() -> bool:
            delayed = [await client.get(f"{pod.url}/demo/delayed") for pod in pods]
            return any(reference in answer.json()["merchantReferences"] for answer in delayed)

        await eventually(sleeping, timeout=10, message="the slow payment to be running")
        assert (await post(client, "/payments", body, key=key)).status_code == 409
        assert (await slow).status_code == 200

        cluster.stop_redis()
        try:
            for _ in range(OUTAGE_REQUESTS):
                down = await post(client, "/payments", payment_body(), key=new_key("down"))
                assert down.status_code == 503
        finally:
            cluster.start_redis()


async def test_every_panel_returns_data_and_the_alerts_evaluate(
    prometheus: Prometheus, redis_cluster: Cluster
) -> None:
    def both_pods_up() -> bool:
        return values(prometheus.query(f'up{{job="{JOB}"}}')) == [1.0, 1.0]

    await eventually(both_pods_up, timeout=30, message="Prometheus to scrape both pods")
    await load(redis_cluster)

    queries = {
        title: as_grafana_sends(query)
        for title, query in panel_queries(json.loads(DASHBOARD.read_text())).items()
    }
    for title, query in queries.items():
        await eventually(
            functools.partial(prometheus.query, query),
            timeout=30,
            interval=0.5,
            message=f"data for the panel {title!r}: {query}",
        )

    # What the load did, each on its panel (a rate over the last minute, above 0).
    shown = ["Acquired", "Replayed", "409", "422", "503", "Store errors"]
    for start in shown:
        ((title, query),) = [(t, q) for t, q in queries.items() if t.startswith(start)]
        await eventually(
            functools.partial(above_zero, prometheus, query),
            timeout=30,
            interval=0.5,
            message=f"the panel {title!r} to show the load",
        )

    rules = [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]
    checked = promtool("check", "rules", ALERTS.name)
    assert len(rules) == int(checked.stdout.split("SUCCESS: ")[1].split()[0])
    assert {rule["health"] for rule in rules} == {"ok"}, rules

    def pending_or_firing() -> list[dict[str, str]]:
        return [alert["labels"] for alert in prometheus.api("alerts")["alerts"]]

    def outage_alerts() -> bool:
        names = {labels["alertname"] for labels in pending_or_firing()}
        return {"IdempotencyStoreErrors", "IdempotencyAnswering503"} <= names

    await eventually(
        outage_alerts, timeout=30, interval=0.5, message="the outage's alerts to be pending"
    )
    # One page for the outage of both pods, whatever operations failed (it fires after 5 min).
    pages = [labels for labels in pending_or_firing() if labels["severity"] == "critical"]
    assert pages == [
        {
            "alertname": "IdempotencyStoreErrors",
            "job": JOB,
            "store": "redis",
            "severity": "critical",
        }
    ]
