"""A uvicorn process on PostgresStore whose database connections the server ends (a
termination, an immediate restart, a crash): the next request is served, not answered 503, and
its retry is a replay."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from starlette_idempotency.testing._isolation import run_admin
from starlette_idempotency.testing._postgres_server import PostgresServer
from tests.support.conditions import eventually_sync
from tests.support.uvicorn import UvicornServer

pytestmark = pytest.mark.postgres


def serve(dsn: str, table: str, application_name: str) -> UvicornServer:
    env = {
        "IDEM_TEST_DSN": dsn,
        "IDEM_TEST_TABLE": table,
        "IDEM_TEST_APPLICATION_NAME": application_name,
    }
    return UvicornServer("tests.stores.postgres_uvicorn_app:create_app", env=env, factory=True)


@pytest.fixture
def app_url(postgres_dsn: str, postgres_table: str, application_name: str) -> Iterator[str]:
    with serve(postgres_dsn, postgres_table, application_name) as server:
        yield server.url


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


@pytest.mark.parametrize("ending", ["immediate restart", "crash"])
def test_request_after_the_server_dropped_the_connections_without_a_word_is_served(
    ending: str, private_postgres: PostgresServer, application_name: str, tmp_path: Path
) -> None:
    """``pg_ctl stop -m immediate``, or a backend killed (the server then ends every other
    connection and recovers): the pool's connections close with no notice that asyncpg could
    read, while the app's event loop is busy."""
    with (
        serve(private_postgres.dsn, "idempotency_keys", application_name) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        first = client.post("/pay", json={}, headers={"Idempotency-Key": "first"})
        assert first.status_code == 200
        run_admin(private_postgres.dsn, "CHECKPOINT")  # synchronous_commit is off

        go = tmp_path / "go"
        with ThreadPoolExecutor(1) as executor:
            headers = {"Idempotency-Key": "second", "X-Wait-For": str(go)}
            sent = executor.submit(client.post, "/pay", json={}, headers=headers)
            eventually_sync(
                (tmp_path / "go.waiting").exists, timeout=10, message="the app to block"
            )
            if ending == "immediate restart":
                private_postgres.stop(mode="immediate")
                private_postgres.start()
            else:
                kill_backends(private_postgres.dsn, application_name)
            go.touch()
            second = sent.result(timeout=30)
        assert second.status_code == 200, second.text

        again = client.post("/pay", json={}, headers={"Idempotency-Key": "second"})
        assert again.headers["x-idempotent-replay"] == "true"
        assert again.json() == second.json()


def kill_backends(dsn: str, application_name: str) -> None:
    """SIGKILL the backends named ``application_name``, and wait until the server has
    recovered from the crash (it ends every other connection too)."""
    query = "SELECT array_agg(pid) FROM pg_stat_activity WHERE application_name = $1"
    pids = run_admin(dsn, query, application_name)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    def recovered() -> bool:
        try:
            return bool(run_admin(dsn, "SELECT NOT pg_is_in_recovery()"))
        except Exception:
            return False

    eventually_sync(recovered, timeout=30, interval=0.1, message="the server to recover")
