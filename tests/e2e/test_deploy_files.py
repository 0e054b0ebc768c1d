"""docker-compose.yml, the nginx configs and the Taskfile agree with each other.

No Docker engine here: the compose file is checked by parsing it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]
from examples.payments import nginx

ROOT = Path(__file__).resolve().parents[2]


def load_yaml(name: str) -> Any:
    return yaml.safe_load((ROOT / name).read_text())


def test_compose_services_ports_and_environment() -> None:
    compose = load_yaml("docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"redis", "postgres", "pod-a", "pod-b", "nginx"}
    assert services["redis"]["image"].startswith("redis:7")
    assert services["postgres"]["image"].startswith("postgres:17")
    assert services["nginx"]["ports"] == ["8080:80"]
    for name in ("pod-a", "pod-b"):
        pod = services[name]
        assert pod["build"]["dockerfile"] == "examples/payments/Dockerfile"
        assert (ROOT / pod["build"]["context"] / pod["build"]["dockerfile"]).is_file()
        env = pod["environment"]
        assert env["POD_ID"] == name
        assert env["REDIS_URL"] == "redis://redis:6379/0"
        assert env["DATABASE_URL"].startswith("postgresql://")
        assert "@postgres:5432/" in env["DATABASE_URL"]
        assert env["IDEMPOTENCY_STORE"] in ("redis", "${IDEMPOTENCY_STORE:-redis}")
        assert str(nginx.COMPOSE_POD_PORT) in " ".join(pod["command"])
        assert set(pod["depends_on"]) == {"redis", "postgres"}
    assert set(services["nginx"]["depends_on"]) == {"pod-a", "pod-b"}


def test_compose_nginx_config_is_the_rendered_template() -> None:
    compose = load_yaml("docker-compose.yml")
    mounts = compose["services"]["nginx"]["volumes"]
    assert "./examples/payments/nginx.compose.conf:/etc/nginx/nginx.conf:ro" in mounts
    rendered = nginx.COMPOSE_CONFIG.read_text()
    assert rendered == nginx.render_compose(), "run: python -m examples.payments.nginx"
    pods = [name for name in compose["services"] if name.startswith("pod-")]
    assert nginx.upstream_servers(rendered) == [f"{pod}:{nginx.COMPOSE_POD_PORT}" for pod in pods]
    assert f"listen {nginx.COMPOSE_NGINX_PORT};" in rendered
    assert "proxy_next_upstream off;" in rendered


def test_local_nginx_config_points_at_the_pods(tmp_path: Path) -> None:
    config = nginx.render_local(pod_ports=[9001, 9002], listen_port=9000, runtime_dir=tmp_path)
    assert nginx.upstream_servers(config) == ["127.0.0.1:9001", "127.0.0.1:9002"]
    assert "listen 127.0.0.1:9000;" in config
    assert "{{" not in config


def test_taskfile_has_the_documented_tasks() -> None:
    taskfile = load_yaml("Taskfile.yml")
    assert str(taskfile["version"]) == "3"
    wanted = {"demo", "test", "test:all", "test:stress:all", "lint", "bench"}
    assert wanted <= set(taskfile["tasks"])
