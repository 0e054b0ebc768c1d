"""The public pytest plugin, run in a project of its own (pytester) as a user would run it.

Each source of servers is taken for real where this machine has it: the environment's URLs
(pointed at this run's servers) and throwaway local servers. There is no Docker engine here, so
the testcontainers branch runs with stand-in container modules that hand out this run's servers,
which checks that the plugin starts and stops what ``services`` chose.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]  # noqa: F401 - see below
import pytest
import redis.asyncio as aioredis

from starlette_idempotency.testing import _services as services
from starlette_idempotency.testing._isolation import run_admin

# asyncpg and redis are imported above, before any test: pytester takes modules first imported
# during a test out of sys.modules again, and asyncpg's extension modules crash the process
# when they are imported a second time.

PLUGIN = "starlette_idempotency.testing.pytest_plugin"

#: A user's tests: each store works, and what the fixtures gave is written down for the outer
#: test to check once the inner run (and its teardown) is over. The plugin's async fixtures
#: must work in pytest-asyncio's strict mode, its default, so the tests carry the marker.
USER_TESTS = """
import json
import os
from pathlib import Path

import pytest

from starlette_idempotency import PostgresStore, RedisStore
from starlette_idempotency._record import IdempotencyRecord, RecordStatus


def pending(key):
    return IdempotencyRecord(
        key=key, status=RecordStatus.IN_PROGRESS, request_fingerprint="sha256:abc",
        owner_token="owner", created_at=1.0, expires_at=4_000_000_000.0,
    )


def write_down(name, **seen):
    Path(f"{name}.json").write_text(json.dumps(seen))


@pytest.mark.asyncio
async def test_redis(redis_url, redis_key_prefix, redis_store):
    assert isinstance(redis_store, RedisStore)
    assert (await redis_store.try_acquire("k", pending("k"), 30)).acquired
    assert await redis_store.get("k") is not None
    write_down("redis", url=redis_url, prefix=redis_key_prefix, env=os.environ.get("REDIS_URL"))


@pytest.mark.asyncio
async def test_postgres(postgres_admin_dsn, postgres_dsn, postgres_table, postgres_store):
    assert isinstance(postgres_store, PostgresStore)
    assert (await postgres_store.try_acquire("k", pending("k"), 30)).acquired
    assert await postgres_store.get("k") is not None
    write_down(
        "postgres", admin_dsn=postgres_admin_dsn, dsn=postgres_dsn, table=postgres_table,
        env=os.environ.get("DATABASE_URL"),
    )
"""


def run_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str
) -> pytest.RunResult:
    """Run pytest on ``pytester``'s project in a process of its own, with the plugins a user's
    project has (loading every plugin installed here takes seconds), in pytest-asyncio's
    default strict mode."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return pytester.runpytest_subprocess(
        "-p",
        "pytest_asyncio.plugin",
        "-p",
        "no:cacheprovider",
        # what pytest-asyncio asks every project to set (it warns otherwise)
        "-o",
        "asyncio_default_fixture_loop_scope=function",
        *args,
        timeout=180,
    )


def run_user_project(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, conftest: str = "", *args: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``USER_TESTS`` in a pytest process of its own, with the plugin loaded from the
    project's conftest (plus ``conftest``); return what the Redis and the PostgreSQL test saw."""
    pytester.makeconftest(f"pytest_plugins = [{PLUGIN!r}]\n{conftest}")
    pytester.makepyfile(test_user=USER_TESTS)
    result = run_project(pytester, monkeypatch, *args)
    result.assert_outcomes(passed=2)
    redis, postgres = (
        json.loads(Path(pytester.path, f"{name}.json").read_text())
        for name in ("redis", "postgres")
    )
    return redis, postgres


async def keys_under(url: str, prefix: str) -> list[bytes]:
    client = aioredis.from_url(url)
    try:
        return [key async for key in client.scan_iter(match=f"{prefix}:*")]
    finally:
        await client.aclose()


def database_exists(admin_dsn: str, dsn: str) -> bool:
    database = urlsplit(dsn).path.lstrip("/")
    return bool(
        run_admin(admin_dsn, "SELECT count(*) FROM pg_database WHERE datname = $1", database)
    )


def test_the_plugin_is_opt_in() -> None:
    """No ``pytest11`` entry point: installing the package adds no fixtures to anyone's run."""
    from importlib.metadata import entry_points

    assert not [ep for ep in entry_points(group="pytest11") if ep.value.startswith("starlette_")]
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert "pytest11" not in pyproject.read_text()


def test_the_environment_urls_are_used_and_left_clean(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    postgres_admin_dsn: str,
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", postgres_admin_dsn)

    redis, postgres = run_user_project(pytester, monkeypatch)

    assert redis["url"] == redis_url
    assert postgres["admin_dsn"] == postgres_admin_dsn
    assert postgres["dsn"] != postgres_admin_dsn  # a database of the run's own on that server
    assert asyncio.run(keys_under(redis_url, redis["prefix"])) == []
    assert not database_exists(postgres_admin_dsn, postgres["dsn"])


#: In the user's conftest: whatever Docker this machine has, the plugin finds none.
NO_DOCKER = """
from starlette_idempotency.testing import _services as services

services.docker_engine_answers = lambda: False
"""

#: In the user's conftest: testcontainers "installed" and Docker "answering", with stand-in
#: containers that hand out this run's servers (named by the outer test's environment) and
#: write down when they start and stop.
STAND_IN_CONTAINERS = """
import os
import sys
import types
from pathlib import Path
from urllib.parse import urlsplit

from starlette_idempotency.testing import _services as services

EVENTS = Path("container-events.txt").resolve()


class StandIn:
    url_variable = ""

    def __init__(self, image, **options):
        self.image = image
        self.url = os.environ[self.url_variable]

    def __enter__(self):
        with EVENTS.open("a") as events:
            events.write(f"start {self.image}\\n")
        return self

    def __exit__(self, *exc_info):
        with EVENTS.open("a") as events:
            events.write(f"stop {self.image}\\n")

    def get_container_host_ip(self):
        return urlsplit(self.url).hostname

    def get_exposed_port(self, port):
        return urlsplit(self.url).port

    def get_connection_url(self):
        return self.url


for name, attribute, variable in (
    ("redis", "RedisContainer", "STAND_IN_REDIS_URL"),
    ("postgres", "PostgresContainer", "STAND_IN_DATABASE_URL"),
):
    module = types.ModuleType(f"testcontainers.community.{name}")
    setattr(module, attribute, type(attribute, (StandIn,), {"url_variable": variable}))
    sys.modules[module.__name__] = module

services.docker_engine_answers = lambda: True
"""


@pytest.mark.services  # it starts a redis-server and a PostgreSQL of its own
def test_without_urls_or_docker_local_servers_are_started_and_stopped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """testcontainers is installed here (the test dependencies carry it) and, where no Docker
    engine answers, its probe is the real one: the fallback to local servers, with warnings as
    errors (a probe that leaked a socket would fail the run)."""
    assert services.machine_probes(services.REDIS_CONTAINERS).testcontainers_installed()
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    conftest = NO_DOCKER if services.docker_engine_answers() else ""

    redis, postgres = run_user_project(pytester, monkeypatch, conftest, "-W", "error")

    assert redis["env"] is None
    assert postgres["env"] is None
    for url in (redis["url"], postgres["admin_dsn"]):
        parts = urlsplit(url)
        assert parts.hostname == "127.0.0.1"
        with pytest.raises(ConnectionRefusedError):  # stopped at the end of the inner run
            socket.create_connection((parts.hostname, parts.port), timeout=2)


def test_with_testcontainers_and_docker_containers_are_started_and_stopped(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    postgres_admin_dsn: str,
) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("STAND_IN_REDIS_URL", redis_url)
    monkeypatch.setenv("STAND_IN_DATABASE_URL", postgres_admin_dsn)

    redis, postgres = run_user_project(pytester, monkeypatch, STAND_IN_CONTAINERS)

    host, port = urlsplit(redis_url).hostname, urlsplit(redis_url).port
    assert redis["url"] == f"redis://{host}:{port}/0"
    assert postgres["admin_dsn"] == postgres_admin_dsn
    events = Path(pytester.path, "container-events.txt").read_text().splitlines()
    assert sorted(events) == sorted(
        f"{verb} {image}"
        for verb in ("start", "stop")
        for image in (services.REDIS_IMAGE, services.POSTGRES_IMAGE)
    )
    assert asyncio.run(keys_under(redis_url, redis["prefix"])) == []
    assert not database_exists(postgres_admin_dsn, postgres["dsn"])


#: A user's conftest on a machine without the drivers: their modules cannot be imported.
WITHOUT_DRIVERS = f"""
import sys

sys.modules["asyncpg"] = None
sys.modules["redis"] = None

pytest_plugins = [{PLUGIN!r}]
"""


def test_without_the_extras_the_fixtures_name_them(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    postgres_admin_dsn: str,
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", postgres_admin_dsn)
    pytester.makeconftest(WITHOUT_DRIVERS)
    pytester.makepyfile(
        test_user="""
        import pytest

        @pytest.mark.asyncio
        async def test_redis(redis_store):
            pass

        @pytest.mark.asyncio
        async def test_postgres(postgres_store):
            pass
        """
    )
    result = run_project(pytester, monkeypatch)
    result.assert_outcomes(errors=2)
    output = result.stdout.str()
    for extra, module in (("redis", "redis"), ("postgres", "asyncpg")):
        assert (
            f"the {extra} fixtures of starlette_idempotency.testing need {module}: "
            f"pip install 'starlette-idempotency[{extra}]'"
        ) in output
    result.stdout.no_fnmatch_line("*No module named*")


def test_the_guides_example_passes_in_strict_mode(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    postgres_admin_dsn: str,
) -> None:
    """docs/how-to/testing.md's example, copied into a project of its own as the guide lays it
    out, run in pytest-asyncio's strict mode (its default) with warnings as errors."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DATABASE_URL", postgres_admin_dsn)
    pytester.makeconftest(f"pytest_plugins = [{PLUGIN!r}]")
    here = Path(__file__).parent
    package = pytester.mkpydir("tests").joinpath("testing")
    package.mkdir()
    package.joinpath("__init__.py").write_text("")
    for name in ("guide_app.py", "test_guide.py"):
        package.joinpath(name).write_text(here.joinpath(name).read_text())

    result = run_project(pytester, monkeypatch, "-o", "asyncio_mode=strict", "-W", "error")
    result.assert_outcomes(passed=9)  # four tests on each of the two stores, and one on memory


#: A user's conftest with a ``postgres_dsn`` of its own (a database the run does not drop), and
#: two tests: one on ``postgres_store``, one creating the table itself on ``postgres_table``.
OWN_DATABASE_CONFTEST = """
import os

import pytest


@pytest.fixture(scope="session")
def postgres_dsn():
    return os.environ["OWN_DATABASE_URL"]
"""
OWN_DATABASE_TESTS = """
from pathlib import Path

import pytest

from starlette_idempotency import PostgresStore


@pytest.mark.asyncio
async def test_fixture_store(postgres_table, postgres_store):
    await postgres_store.create_schema()
    Path("fixture-store.txt").write_text(postgres_table)


@pytest.mark.asyncio
async def test_own_store(postgres_dsn, postgres_table):
    store = PostgresStore.from_dsn(postgres_dsn, table=postgres_table)
    await store.create_schema()
    await store.aclose()
    Path("own-store.txt").write_text(postgres_table)
"""


def test_an_overridden_postgres_dsn_keeps_no_tables(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, postgres_dsn: str
) -> None:
    monkeypatch.setenv("OWN_DATABASE_URL", postgres_dsn)
    pytester.makeconftest(f"pytest_plugins = [{PLUGIN!r}]\n{OWN_DATABASE_CONFTEST}")
    pytester.makepyfile(test_user=OWN_DATABASE_TESTS)
    run_project(pytester, monkeypatch, "-W", "error").assert_outcomes(passed=2)
    tables = [
        Path(pytester.path, name).read_text() for name in ("fixture-store.txt", "own-store.txt")
    ]
    assert len(set(tables)) == 2
    for table in tables:
        assert run_admin(postgres_dsn, "SELECT to_regclass($1) IS NULL", table) is True
