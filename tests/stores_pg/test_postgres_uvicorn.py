"""A uvicorn process on PostgresStore whose database connections the server ends: the next
request is served, not answered 503, and its retry is a replay."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from starlette_idempotency.testing._process import free_port, stop_process, wait_until

pytestmark = pytest.mark.postgres

REPO_ROOT = Path(__file__).resolve().parents[2]


def serving(url: str, process: subprocess.Popen[bytes]) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"uvicorn exited with {process.returncode}")
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def app_url(postgres_dsn: str, postgres_table: str, application_name: str) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        "IDEM_TEST_DSN": postgres_dsn,
        "IDEM_TEST_TABLE": postgres_table,
        "IDEM_TEST_APPLICATION_NAME": application_name,
    }
    command = [sys.executable, "-m", "uvicorn", "--factory"]
    command += ["tests.stores_pg.uvicorn_app:create_app", "--port", str(port)]
    command += ["--log-level", "warning", "--no-access-log"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: serving(url, process), timeout=20, what="the uvicorn app")
        yield url
    finally:
        stop_process(process)


def test_request_after_the_server_ended_the_connections_is_served(app_url: str) -> None:
    with httpx.Client(base_url=app_url, timeout=10) as client:
        first = client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": "first"})
        assert first.status_code == 200
        assert first.json() == {"run": 1, "terminated": None}

        headers = {"Idempotency-Key": "second", "X-Terminate-Connections": "1"}
        second = client.post("/pay", json={"amount": 2}, headers=headers)
        assert second.status_code == 200, second.text
        assert second.json() == {"run": 2, "terminated": 2}  # both pooled connections ended

        again = client.post("/pay", json={"amount": 2}, headers={"Idempotency-Key": "second"})
        assert again.status_code == 200
        assert again.headers["x-idempotent-replay"] == "true"
        assert again.json() == second.json()
