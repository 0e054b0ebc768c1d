"""Every way an app can be wired, through real uvicorn processes on every store: what the app
treats as guarded is guarded or refused, and requests it tells apart never share a record.

See ``tests/e2e/apps/wiring.py`` for the apps; ``tests/core/test_wiring.py`` has the same
cases in process, with what each refusal says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from starlette_idempotency.testing._processes import free_port
from tests.support.uvicorn import REPO_ROOT, UvicornServer

pytestmark = pytest.mark.e2e

STORES = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=STORES)
def store_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that points ``tests/e2e/apps/wiring.py`` at one store."""
    kind: str = request.param
    env = {"IDEM_TEST_STORE": kind}
    if kind == "redis":
        env["IDEM_TEST_REDIS_URL"] = request.getfixturevalue("redis_url")
        env["IDEM_TEST_PREFIX"] = request.getfixturevalue("redis_key_prefix")
    elif kind == "postgres":
        env["IDEM_TEST_DSN"] = request.getfixturevalue("postgres_dsn")
        env["IDEM_TEST_TABLE"] = request.getfixturevalue("postgres_table")
    return env


# uvicorn ends the connection after an app's exception: not one to keep alive.
CLOSE = {"Connection": "close"}


def serve(app: str, env: dict[str, str] | None = None) -> UvicornServer:
    return UvicornServer(f"tests.e2e.apps.wiring:{app}", env=env, factory=True)


@pytest.fixture
def server(store_env: dict[str, str]) -> Iterator[UvicornServer]:
    with serve("create_app", store_env) as running:
        yield running


def key() -> dict[str, str]:
    return {"Idempotency-Key": uuid.uuid4().hex, "X-User": "1"}


def post_twice(client: httpx.Client, url: str, **kwargs: Any) -> list[httpx.Response]:
    headers = {**key(), **kwargs.pop("headers", {})}
    return [client.post(url, headers=headers, **kwargs) for _ in range(2)]


def assert_guarded(client: httpx.Client, url: str, counter: str, **kwargs: Any) -> None:
    before = client.get("/runs").json().get(counter, 0)
    first, retry = post_twice(client, url, **kwargs)
    assert first.status_code == 201, first.text
    assert retry.headers.get("x-idempotent-replay") == "true", retry.text
    assert retry.json() == first.json()
    assert client.post(url, **kwargs).status_code == 400  # no key
    assert client.get("/runs").json().get(counter, 0) == before + 1


def test_class_endpoints_partials_and_mounted_apps_are_guarded(server: UvicornServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert_guarded(client, "/orders", "class")
        assert_guarded(client, "/charges", "partial")
        assert_guarded(client, "/graphql/", "graphql", content=b"mutation { pay }")


def test_a_path_rewritten_inside_the_guard_is_refused(server: UvicornServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        refused = client.post("/v1/charges", headers={**key(), **CLOSE})
        assert refused.status_code == 500
        assert client.get("/runs").json().get("partial", 0) == 0


def test_hosts_and_tenants_never_share_a_record(server: UvicornServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as client:
        headers = key()
        answers: dict[str, Any] = {}
        for host in ("api.example", "admin.example", "acme.shop.example", "globex.shop.example"):
            for _ in range(2):
                answer = client.post("/op", json={}, headers={**headers, "Host": host})
                assert answer.status_code == 201, answer.text
                answers.setdefault(host, answer.json())
                assert answer.json() == answers[host]
        assert [answer["host"] for answer in answers.values()] == [
            "api.example",
            "admin.example",
            "acme",
            "globex",
        ]
        counted = client.get("/runs").json()
        assert [counted[name] for name in ("api.example", "admin.example", "acme", "globex")] == [
            1,
            1,
            1,
            1,
        ]


def test_a_wraps_decorator_above_idempotent_is_guarded_and_runs_once(
    store_env: dict[str, str],
) -> None:
    with (
        serve("create_stacked_app", store_env) as server,
        httpx.Client(base_url=server.url, timeout=10) as client,
    ):
        for url, counter in (("/payments", "pay"), ("/refunds", "refund")):
            first, retry = post_twice(client, url, json={"amount": 1})
            assert first.status_code == 201, first.text
            assert retry.headers.get("x-idempotent-replay") == "true", retry.text
            assert retry.json() == first.json() == {"run": 1}
            assert client.get("/runs").json()[counter] == 1


def refused_boot(app: str, env: dict[str, str] | None = None) -> str:
    """What uvicorn prints when the app ``app`` refuses to start (it must exit, never serve)."""
    command = [sys.executable, "-m", "uvicorn", f"tests.e2e.apps.wiring:{app}", "--factory"]
    finished = subprocess.run(
        [*command, "--port", str(free_port())],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0, output
    assert "Application startup complete" not in output
    return output


def test_a_decorated_route_serving_post_and_put_refuses_to_start() -> None:
    output = refused_boot("create_post_and_put_app")
    assert "@idempotent on /items serves POST, PUT" in output
    assert "its PUT requests would run unguarded. Split the route" in output


def test_a_misconfigured_mounted_app_stops_the_outer_apps_boot() -> None:
    output = refused_boot("create_mounting_app")
    assert "the IdempotencyMiddleware of the app mounted at /sub: ttl_hours" in output


def test_a_mounted_app_with_no_lifespan_refuses_its_requests_with_the_cause() -> None:
    with (
        serve("create_unguarded_mounting_app") as server,
        httpx.Client(base_url=server.url) as client,
    ):
        for method in ("PUT", "POST"):
            answer = client.request(method, "/sub/items", headers={**key(), **CLOSE})
            assert answer.status_code == 500
        assert client.get("/runs").json() == {}


def test_an_app_without_the_middleware_refuses_its_decorated_routes() -> None:
    with serve("create_unguarded_app") as server, httpx.Client(base_url=server.url) as client:
        for url in ("/orders", "/charges"):
            assert client.post(url, headers={**key(), **CLOSE}).status_code == 500
        assert client.get("/runs").json() == {}


def on_a_shared_store(store_env: dict[str, str]) -> None:
    if store_env["IDEM_TEST_STORE"] == "memory":
        pytest.skip("a MemoryStore is never shared by two processes")


@pytest.mark.parametrize("first", ["ledger", "notifications"])
def test_two_services_on_one_store_each_run_their_own_requests(
    store_env: dict[str, str], first: str
) -> None:
    """A gateway forwards one key to two services on one store, both serving
    ``POST /v1/events``: each names its operation, and runs its own request."""
    on_a_shared_store(store_env)
    second = "notifications" if first == "ledger" else "ledger"
    with (
        serve("create_service", {**store_env, "IDEM_TEST_SERVICE": first}) as one,
        serve("create_service", {**store_env, "IDEM_TEST_SERVICE": second}) as other,
        httpx.Client(timeout=10) as client,
    ):
        headers = {"Idempotency-Key": f"evt-{uuid.uuid4().hex}"}
        event = {"type": "payment.settled", "id": 7}
        for _ in range(2):
            answers = [
                client.post(f"{server.url}/v1/events", json=event, headers=headers)
                for server in (one, other)
            ]
            assert [answer.json() for answer in answers] == [
                {"service": first, "run": 1},
                {"service": second, "run": 1},
            ]
        assert answers[0].headers.get("x-idempotent-replay") == "true"
        assert answers[1].headers.get("x-idempotent-replay") == "true"


@pytest.mark.parametrize("first", ["ledger", "notifications"])
def test_two_services_on_one_store_with_default_settings_refuse_the_second(
    store_env: dict[str, str], first: str
) -> None:
    """Neither names its operation: the second to start refuses, naming both handlers and
    what to set, and the first runs its own requests."""
    on_a_shared_store(store_env)
    second = "notifications" if first == "ledger" else "ledger"
    defaults = {**store_env, "IDEM_TEST_DEFAULTS": "1"}
    with (
        serve("create_service", {**defaults, "IDEM_TEST_SERVICE": first}) as one,
        httpx.Client(base_url=one.url, timeout=10) as client,
    ):
        output = refused_boot("create_service", {**defaults, "IDEM_TEST_SERVICE": second})
        assert f"POST /v1/events is guarded on {store_env['IDEM_TEST_STORE']}" in output, output
        assert (
            f"by tests.e2e.apps.wiring:{second} here and by tests.e2e.apps.wiring:{first} in a "
            "process that is running" in output
        ), output
        assert "their own key_prefix, or their own names" in output
        answer = client.post("/v1/events", json={}, headers={"Idempotency-Key": uuid.uuid4().hex})
        assert answer.json() == {"service": first, "run": 1}


def test_a_retry_across_a_renamed_handler_is_replayed(store_env: dict[str, str]) -> None:
    """Version 1 of an app answers; version 2, its handler renamed and moved, takes over the
    store (a deploy) and replays that answer to the retry."""
    on_a_shared_store(store_env)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with (
        serve("create_payments", {**store_env, "IDEM_TEST_VERSION": "1"}) as old,
        httpx.Client(base_url=old.url, timeout=10) as client,
    ):
        first = client.post("/payments", json={"amount": 1}, headers=headers)
        assert first.json() == {"version": 1, "run": 1}
    with (
        serve("create_payments", {**store_env, "IDEM_TEST_VERSION": "2"}) as new,
        httpx.Client(base_url=new.url, timeout=10) as client,
    ):
        retry = client.post("/payments", json={"amount": 1}, headers=headers)
        assert retry.headers.get("x-idempotent-replay") == "true", retry.text
        assert retry.json() == {"version": 1, "run": 1}
        assert client.get("/runs").json() == {}
