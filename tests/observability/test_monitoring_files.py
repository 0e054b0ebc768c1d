"""monitoring/: the Prometheus alerting rules, checked and unit-tested by promtool (each alert
firing and quiet), and the Grafana dashboard's panels."""

from __future__ import annotations

import json
from typing import Any

import yaml  # type: ignore[import-untyped]

from tests.support.prometheus import ALERT_TESTS, ALERTS, DASHBOARD, panel_queries, promtool


def alert_names() -> list[str]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", ALERTS.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in checked.stdout


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for case in test["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert {name: {True, False} for name in alert_names()} == cases

    tested = promtool("test", "rules", ALERT_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_a_broken_expectation_fails_the_unit_tests(tmp_path: Any) -> None:
    """The unit tests can fail: the same tests expecting another severity do."""
    changed = ALERT_TESTS.read_text().replace("severity: critical", "severity: page", 1)
    (tmp_path / ALERTS.name).write_text(ALERTS.read_text())
    (tmp_path / ALERT_TESTS.name).write_text(changed)
    tested = promtool("test", "rules", str(tmp_path / ALERT_TESTS.name))
    assert tested.returncode == 1
    assert "FAILED" in tested.stdout + tested.stderr


def test_the_dashboard_shows_what_an_operator_watches() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = panel_queries(dashboard)
    wanted = {
        "Acquired": 'result="ACQUIRED"',
        "Replayed": 'result="REPLAYED"',
        "409": "idempotency_conflict_total",
        "422": 'result="MISMATCH"',
        "503": 'result="STORE_ERROR"',
        "Store latency": "idempotency_store_latency_seconds_bucket",
        "Store errors": "idempotency_store_errors_total",
        "Lock loss": 'result="LOCK_LOST"',
        "Processing timeouts": "idempotency_processing_timeout_total",
        "Waiting duplicates": "idempotency_waiting_requests",
    }
    for title_start, needle in wanted.items():
        (query,) = [q for title, q in queries.items() if title.startswith(title_start)]
        assert needle in query, (title_start, query)
    by_route = [q for q in queries.values() if "idempotency_requests_total" in q]
    assert all("endpoint" in query for query in by_route)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job"}
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
