"""A real Prometheus for the monitoring tests (Debian's ``prometheus`` package): a private
server on a free port, a temporary data directory, a short scrape interval, and the queries the
tests ask through its HTTP API."""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import starlette_idempotency
from starlette_idempotency.testing._processes import (
    Managed,
    free_port,
    require_binary,
    stop_process,
    wait_until,
)

INSTALL_HINT = "apt-get install prometheus"
#: The monitoring kit, package data of the wheel (``starlette-idempotency monitoring``).
MONITORING = Path(starlette_idempotency.__file__).parent / "monitoring"
ALERTS = MONITORING / "prometheus-alerts.yml"
ALERT_TESTS = MONITORING / "prometheus-alerts.test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_binary("promtool", hint=INSTALL_HINT)
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=120, check=False, cwd=MONITORING
    )


def panel_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each panel's title and the PromQL of its one target."""
    return {panel["title"]: panel["targets"][0]["expr"] for panel in dashboard["panels"]}


class Prometheus(Managed):
    """``prometheus`` scraping ``targets`` (host:port) as job ``job`` every ``interval``, with
    ``rule_files`` loaded and evaluated as often."""

    def __init__(
        self,
        targets: Sequence[str],
        *,
        job: str,
        metrics_path: str = "/metrics",
        rule_files: Sequence[Path] = (),
        interval: str = "1s",
    ) -> None:
        self.binary = require_binary("prometheus", hint=INSTALL_HINT)
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="prometheus-")
        self.directory = Path(self._tmp.name)
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(path) for path in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": metrics_path,
                    "static_configs": [{"targets": list(targets)}],
                }
            ],
        }
        # JSON is YAML: no YAML writer needed.
        (self.directory / "prometheus.yml").write_text(json.dumps(config))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        log = open(self.directory / "prometheus.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()
        wait_until(self._ready, timeout=30, what=f"prometheus on {self.port}")
        return self

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            log = (self.directory / "prometheus.log").read_text(errors="replace")
            raise RuntimeError(f"prometheus exited:\n{log}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/<path>``'s ``data``, failing on anything but success."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {...}, "value": [time, "value"]}, ...]``."""
        data = self.api("query", query=promql)
        assert data["resultType"] == "vector", data
        result: list[dict[str, Any]] = data["result"]
        return result

    def close(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None
        self._tmp.cleanup()
