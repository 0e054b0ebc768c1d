"""examples/payments/k8s/payments.yaml agrees with the demo app and its Dockerfile: its probes
are routes of the app (readiness on the store's check), its ports are the ones uvicorn
listens on, and the Service selects the Deployment's pods.

No cluster here: the manifest is checked by parsing it, and its probes by calling them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from examples.payments.app import Settings, build_api
from starlette.routing import Match

from starlette_idempotency.readiness import DEFAULT_READINESS_TIMEOUT
from starlette_idempotency.testing._isolation import unique_prefix
from starlette_idempotency.testing._processes import free_port
from tests.support.uvicorn import UvicornServer

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples/payments/k8s/payments.yaml"
PROBES = ("readinessProbe", "livenessProbe")


def documents() -> dict[str, Any]:
    """The manifest's objects by kind."""
    loaded = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    by_kind = {doc["kind"]: doc for doc in loaded}
    assert len(by_kind) == len(loaded) == 2
    return by_kind


def container() -> dict[str, Any]:
    [app] = documents()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return dict(app)


def demo_settings() -> Settings:
    """Settings whose stores are never reached (nothing connects before the first request)."""
    return Settings(database_url="postgresql://app@db/payments", redis_url="redis://cache:6379/0")


def route_for(app: Any, path: str) -> Any:
    scope = {"type": "http", "path": path, "method": "GET", "root_path": ""}
    matches = [route for route in app.routes if route.matches(scope)[0] is Match.FULL]
    assert matches, f"no GET route of the demo app answers {path}"
    return matches[0]


def test_the_service_selects_the_deployment_on_the_container_port() -> None:
    objects = documents()
    deployment, service = objects["Deployment"], objects["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    [port] = service["spec"]["ports"]
    names = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert port["targetPort"] in names


def test_the_container_runs_the_dockerfile_command_on_its_declared_port() -> None:
    app = container()
    command = app["command"]
    [http] = [p for p in app["ports"] if p["name"] == "http"]
    assert command[command.index("--port") + 1] == str(http["containerPort"])
    dockerfile = (ROOT / "examples/payments/Dockerfile").read_text()
    assert f"EXPOSE {http['containerPort']}" in dockerfile
    assert re.search(r'"--factory", "examples\.payments\.app:create_app"', dockerfile)
    assert command[:3] == ["uvicorn", "--factory", "examples.payments.app:create_app"]


def test_the_probes_are_routes_of_the_demo_app() -> None:
    app = build_api(demo_settings())
    probes = {kind: container()[kind]["httpGet"] for kind in PROBES}
    for probe in probes.values():
        assert probe["port"] == "http"
        route_for(app, probe["path"])
    assert route_for(app, probes["readinessProbe"]["path"]).name == "idempotency_readiness"
    # The probe waits longer than the check, so a slow store answers 503 with its cause.
    assert container()["readinessProbe"]["timeoutSeconds"] > DEFAULT_READINESS_TIMEOUT
    # Liveness must not follow the store: an outage would restart every pod.
    assert probes["livenessProbe"]["path"] != probes["readinessProbe"]["path"]


@pytest.mark.e2e
def test_the_probes_answer_through_uvicorn_on_a_working_and_a_broken_store(
    redis_url: str, postgres_dsn: str
) -> None:
    paths = {kind: container()[kind]["httpGet"]["path"] for kind in PROBES}
    broken = f"redis://127.0.0.1:{free_port()}/0"
    for redis, ready in ((redis_url, 200), (broken, 503)):
        env = {
            "DATABASE_URL": postgres_dsn,
            "REDIS_URL": redis,
            "IDEMPOTENCY_KEY_PREFIX": unique_prefix(),
        }
        with UvicornServer("examples.payments.app:create_app", env=env, factory=True) as pod:
            readiness = httpx.get(pod.url + paths["readinessProbe"], timeout=10)
            liveness = httpx.get(pod.url + paths["livenessProbe"], timeout=10)
        assert readiness.status_code == ready, readiness.text
        assert liveness.status_code == 200, liveness.text
