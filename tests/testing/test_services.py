"""Where the fixtures get their servers from: the choice, over fake probes, and the thin layer
that starts what was chosen. No Docker engine runs where this suite runs, so the testcontainers
branch is tested here against stand-in modules; the environment and local branches also run
for real (``test_pytest_plugin.py`` and every test that uses the servers)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from starlette_idempotency.testing import _services as services
from starlette_idempotency.testing._postgres_server import PostgresServer
from starlette_idempotency.testing._redis_server import RedisServer, redis_command
from starlette_idempotency.testing._services import (
    Choice,
    Probes,
    Source,
    choose_source,
    postgres_service,
    redis_service,
)


def probe(answer: bool, calls: list[str], name: str) -> Callable[[], bool]:
    def ask() -> bool:
        calls.append(name)
        return answer

    return ask


def probes(environ: dict[str, str], *, installed: bool, docker: bool, calls: list[str]) -> Probes:
    return Probes(
        environ=environ,
        testcontainers_installed=probe(installed, calls, "installed"),
        docker_answers=probe(docker, calls, "docker"),
    )


@pytest.mark.parametrize("installed", [False, True])
@pytest.mark.parametrize("docker", [False, True])
def test_an_environment_url_wins_without_probing_anything(installed: bool, docker: bool) -> None:
    calls: list[str] = []
    environ = {"REDIS_URL": "redis://cache:6379/2"}
    choice = choose_source(
        "REDIS_URL", probes(environ, installed=installed, docker=docker, calls=calls)
    )
    assert choice == Choice(
        Source.ENVIRONMENT, "REDIS_URL", "REDIS_URL is set", "redis://cache:6379/2"
    )
    assert calls == []


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_environment_url_counts_as_unset(blank: str) -> None:
    calls: list[str] = []
    choice = choose_source(
        "DATABASE_URL", probes({"DATABASE_URL": blank}, installed=False, docker=True, calls=calls)
    )
    assert choice.source is Source.LOCAL
    assert choice.url is None


def test_without_testcontainers_docker_is_not_asked() -> None:
    calls: list[str] = []
    choice = choose_source("REDIS_URL", probes({}, installed=False, docker=True, calls=calls))
    assert choice.source is Source.LOCAL
    assert choice.reason == "REDIS_URL is not set and testcontainers is not installed"
    assert calls == ["installed"]


def test_testcontainers_without_a_docker_engine_falls_back_to_a_local_server() -> None:
    calls: list[str] = []
    choice = choose_source("DATABASE_URL", probes({}, installed=True, docker=False, calls=calls))
    assert choice.source is Source.LOCAL
    assert choice.reason == "DATABASE_URL is not set and no Docker engine answers"
    assert calls == ["installed", "docker"]


def test_testcontainers_with_a_docker_engine_starts_a_container() -> None:
    calls: list[str] = []
    choice = choose_source(
        "REDIS_URL", probes({"OTHER": "x"}, installed=True, docker=True, calls=calls)
    )
    assert choice.source is Source.TESTCONTAINERS
    assert calls == ["installed", "docker"]


def test_machine_probes_read_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://from-env:6379/0")
    choice = choose_source("REDIS_URL", services.machine_probes(services.REDIS_CONTAINERS))
    assert choice.url == "redis://from-env:6379/0"
    assert not services.module_installed("no_such_package_here.redis")
    assert services.module_installed("starlette_idempotency.testing._services")


# --- the Docker probe -------------------------------------------------------------------------


class FakeDockerClient:
    def __init__(self, ping: Callable[[], bool]) -> None:
        self.ping = ping
        self.closed = False

    def close(self) -> None:
        self.closed = True


def fake_docker(monkeypatch: pytest.MonkeyPatch, from_env: Callable[..., Any]) -> None:
    module = types.ModuleType("docker")
    module.from_env = from_env  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "docker", module)


def test_docker_answers_when_its_engine_pings(monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[FakeDockerClient] = []

    def from_env(*, timeout: float) -> FakeDockerClient:
        clients.append(FakeDockerClient(lambda: True))
        return clients[-1]

    fake_docker(monkeypatch, from_env)
    assert services.docker_engine_answers()
    assert clients[0].closed


def test_docker_does_not_answer_when_the_ping_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> bool:
        raise ConnectionError("connection refused")

    client = FakeDockerClient(refuse)
    fake_docker(monkeypatch, lambda *, timeout: client)
    assert not services.docker_engine_answers()
    assert client.closed


def test_docker_does_not_answer_without_an_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def from_env(*, timeout: float) -> FakeDockerClient:
        raise OSError("Error while fetching server API version")

    fake_docker(monkeypatch, from_env)
    assert not services.docker_engine_answers()


def test_docker_does_not_answer_without_its_client_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "docker", None)  # makes `import docker` fail
    assert not services.docker_engine_answers()


# --- starting what was chosen ---------------------------------------------------------------


class FakeContainer:
    """What the services module uses of testcontainers' containers, recording its life."""

    def __init__(self, image: str, **options: Any) -> None:
        self.image = image
        self.options = options
        self.events: list[str] = []
        FakeContainer.made.append(self)

    made: list[FakeContainer] = []  # noqa: RUF012 - a record of the instances, reset per test

    def __enter__(self) -> FakeContainer:
        self.events.append("started")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.events.append("stopped")

    def get_container_host_ip(self) -> str:
        return "docker-host"

    def get_exposed_port(self, port: int) -> int:
        return 40000 + port

    def get_connection_url(self) -> str:
        return f"postgresql://test:test@docker-host:{self.get_exposed_port(5432)}/test"


def install_containers(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Stand-in modules for testcontainers' Redis and PostgreSQL under ``package``."""
    for name, attribute in (("redis", "RedisContainer"), ("postgres", "PostgresContainer")):
        module = types.ModuleType(f"{package}.{name}")
        setattr(module, attribute, FakeContainer)
        monkeypatch.setitem(sys.modules, f"{package}.{name}", module)


@pytest.fixture(params=["testcontainers.community", "testcontainers"])
def containers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> list[FakeContainer]:
    """The containers made, with testcontainers' modules where 4.15+ has them or before (the
    newer layout, which testcontainers installed here has, hidden for the older one)."""
    FakeContainer.made = []
    for name in (*services.REDIS_CONTAINERS, *services.POSTGRES_CONTAINERS):
        monkeypatch.setitem(sys.modules, name, None)
    install_containers(monkeypatch, request.param)
    return FakeContainer.made


def test_redis_from_testcontainers(containers: list[FakeContainer]) -> None:
    choice = Choice(Source.TESTCONTAINERS, "REDIS_URL", "Docker answers")
    with redis_service(choice) as url:
        assert url == "redis://docker-host:46379/0"
        assert containers[0].image == services.REDIS_IMAGE
        assert containers[0].events == ["started"]
    assert containers[0].events == ["started", "stopped"]


def test_postgres_from_testcontainers_is_a_plain_libpq_url(containers: list[FakeContainer]) -> None:
    choice = Choice(Source.TESTCONTAINERS, "DATABASE_URL", "Docker answers")
    with postgres_service(choice) as dsn:
        assert dsn == "postgresql://test:test@docker-host:45432/test"
        assert containers[0].image == services.POSTGRES_IMAGE
        assert containers[0].options == {"driver": None}
    assert containers[0].events == ["started", "stopped"]


@pytest.mark.parametrize("start", [redis_service, postgres_service])
def test_an_environment_url_is_used_as_it_is(
    start: Callable[[Choice], Any], containers: list[FakeContainer]
) -> None:
    choice = Choice(Source.ENVIRONMENT, "X_URL", "X_URL is set", "scheme://somewhere/0")
    with start(choice) as url:
        assert url == "scheme://somewhere/0"
    assert containers == []


def test_the_newer_module_layout_is_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    install_containers(monkeypatch, "testcontainers")
    assert services.module_installed("testcontainers.redis")
    monkeypatch.setattr(FakeContainer, "made", [])
    community = types.ModuleType("testcontainers.community.redis")
    community.RedisContainer = type("CommunityContainer", (FakeContainer,), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "testcontainers.community.redis", community)
    with redis_service(Choice(Source.TESTCONTAINERS, "REDIS_URL", "Docker answers")):
        assert [type(made).__name__ for made in FakeContainer.made] == ["CommunityContainer"]


def test_probes_find_either_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    for modules in (services.REDIS_CONTAINERS, services.POSTGRES_CONTAINERS):
        for name in modules:
            monkeypatch.setitem(sys.modules, name, None)  # whatever is installed here: absent
        assert not services.machine_probes(modules).testcontainers_installed()
        monkeypatch.setitem(sys.modules, modules[-1], types.ModuleType(modules[-1]))
        assert services.machine_probes(modules).testcontainers_installed()


def test_missing_local_binaries_name_every_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_binary() -> RedisServer:
        raise FileNotFoundError("redis-server not found; install it: apt-get install redis-server")

    monkeypatch.setattr(services, "RedisServer", no_binary)
    choice = Choice(Source.LOCAL, "REDIS_URL", "REDIS_URL is not set and no Docker engine answers")
    with pytest.raises(FileNotFoundError) as raised, redis_service(choice):
        pass
    message = str(raised.value)
    assert message.startswith("redis-server not found; install it")
    assert "because REDIS_URL is not set and no Docker engine answers" in message
    assert "set REDIS_URL to a running server" in message
    assert "starlette-idempotency[testcontainers]" in message


def test_a_local_server_is_started_and_stopped() -> None:
    choice = Choice(Source.LOCAL, "REDIS_URL", "REDIS_URL is not set")
    with redis_service(choice) as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert redis_command(port, "PING") == b"+PONG\r\n"
    with pytest.raises(ConnectionRefusedError):
        redis_command(port, "PING")


@pytest.mark.redis
def test_a_redis_server_never_adopts_another_on_its_port() -> None:
    """Another server answered PING on the port while this one failed to bind: the test then
    ran against the other one, and froze or stopped nothing of its own."""
    with RedisServer() as other:
        taken = RedisServer(port=other.port)
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                taken.start()
        finally:
            taken.close()
        assert redis_command(other.port, "PING") == b"+PONG\r\n"


@pytest.mark.postgres
def test_a_postgres_server_never_adopts_another_on_its_port() -> None:
    with PostgresServer() as other:
        taken = PostgresServer(port=other.port, startup_timeout=2)
        try:
            with pytest.raises(TimeoutError, match="Address already in use"):
                taken.start()
        finally:
            taken.close()
