"""The monitoring kit (package data, ``starlette-idempotency monitoring``): the Prometheus
alerting rules, checked and unit-tested by promtool (each alert firing and quiet, one page per
outage and none for a blip), their runbook, and the Grafana dashboard's panels."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from starlette_idempotency.cli import main
from tests.support.prometheus import (
    ALERT_TESTS,
    ALERTS,
    DASHBOARD,
    MONITORING,
    panel_queries,
    promtool,
)

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK = ROOT / "docs" / "how-to" / "runbook.md"


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alert_names() -> list[str]:
    return [rule["alert"] for rule in rules()]


def unit_tests_of(changed_rules: str, tmp_path: Path) -> str:
    """promtool's unit tests run against ``changed_rules``: their output, when they fail."""
    (tmp_path / ALERTS.name).write_text(changed_rules)
    (tmp_path / ALERT_TESTS.name).write_text(ALERT_TESTS.read_text())
    tested = promtool("test", "rules", str(tmp_path / ALERT_TESTS.name))
    assert tested.returncode == 1, tested.stdout
    return tested.stdout + tested.stderr


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


def test_one_outage_pages_once() -> None:
    """The only critical rule is the store's, one alert per job and store, held for 5 minutes."""
    critical = [rule for rule in rules() if rule["labels"]["severity"] == "critical"]
    assert [rule["alert"] for rule in critical] == ["IdempotencyStoreErrors"]
    assert re.findall(r"sum by \(([\w, ]+)\)", critical[0]["expr"]) == ["job, store"] * 2
    assert critical[0]["for"] == "5m"


def test_the_unit_tests_catch_a_page_for_one_error_and_two_pages_for_one_outage(
    tmp_path: Path,
) -> None:
    quick = ALERTS.read_text().replace("for: 5m", "for: 2m", 1)
    assert "a single store error pages nobody" in unit_tests_of(quick, tmp_path)
    per_operation = ALERTS.read_text().replace(
        "sum by (job, store)", "sum by (job, store, operation)"
    )
    assert "a sustained outage pages once" in unit_tests_of(per_operation, tmp_path)
    misspelt = ALERTS.read_text().replace('{reason="event_loop_blocked"}', '{reason="blocked"}')
    assert "the first blocked event loop" in unit_tests_of(misspelt, tmp_path)


def test_every_rule_links_its_section_of_the_runbook() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"]
    sections = re.findall(r"^## (\w+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    assert sections == alert_names()
    for rule in rules():
        anchor = rule["alert"].lower()  # the id mkdocs gives the heading
        assert rule["annotations"]["runbook_url"] == f"{site}how-to/runbook/#{anchor}"


def test_the_command_writes_the_kit_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kit = sorted(path.name for path in MONITORING.iterdir())
    assert kit == ["grafana-dashboard.json", "prometheus-alerts.test.yml", "prometheus-alerts.yml"]
    assert main(["monitoring"]) == 0
    assert capsys.readouterr().out.split()[2:] == kit

    target = tmp_path / "rules"
    assert main(["monitoring", "--write", str(target)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"monitoring: wrote {target / name}" for name in kit
    ]
    for name in kit:
        assert (target / name).read_bytes() == (MONITORING / name).read_bytes()
    tested = promtool("test", "rules", str(target / ALERT_TESTS.name))
    assert tested.returncode == 0, tested.stdout + tested.stderr

    (target / ALERTS.name).write_text("# my thresholds\n")
    assert main(["monitoring", "--write", str(target)]) == 1
    assert capsys.readouterr().err == (
        f"starlette-idempotency: error: {target / ALERTS.name}: exists with other content; "
        "--force overwrites\n"
    )
    assert (target / ALERTS.name).read_text() == "# my thresholds\n"
    assert main(["monitoring", "--write", str(target), "--force"]) == 0
    assert (target / ALERTS.name).read_bytes() == ALERTS.read_bytes()


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
