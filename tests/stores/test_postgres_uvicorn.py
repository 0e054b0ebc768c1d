"""A uvicorn process on PostgresStore whose database connections the server ends: the next
request is served, not answered 503, and its retry is a replay."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.uvicorn import UvicornServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def app_url(postgres_dsn: str, postgres_table: str, application_name: str) -> Iterator[str]:
    env = {
        "IDEM_TEST_DSN": postgres_dsn,
        "IDEM_TEST_TABLE": postgres_table,
        "IDEM_TEST_APPLICATION_NAME": application_name,
    }
    app = "tests.stores.postgres_uvicorn_app:create_app"
    with UvicornServer(app, env=env, factory=True) as server:
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
