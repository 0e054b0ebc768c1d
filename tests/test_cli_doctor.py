"""``starlette-idempotency doctor --redis``, ``--version``, and the one line a missing extra
gets, each run as a subprocess the way a user runs it (PostgreSQL:
``stores/test_postgres_cli.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from starlette_idempotency import __version__
from starlette_idempotency.testing._processes import free_port
from starlette_idempotency.testing._redis_server import RedisServer
from tests.support.cli import Ran, assert_unreachable, cli, run

SCRIPT = Path(sys.executable).with_name("starlette-idempotency")
# Runs the command with some modules made unimportable, as if their extra were not installed.
HIDING = "import sys\nfor name in sys.argv.pop(1).split(','): sys.modules[name] = None\n"
RUN_CLI = HIDING + "from starlette_idempotency.cli import main\nsys.exit(main())\n"


def cli_without(modules: str, *args: str) -> Ran:
    return run(sys.executable, "-c", RUN_CLI, modules, *args)


def where(url: str) -> str:
    return url.removeprefix("redis://")


def test_version_from_the_installed_script() -> None:
    ran = run(str(SCRIPT), "--version")
    assert (ran.code, ran.out, ran.err) == (0, f"starlette-idempotency {__version__}\n", "")


@pytest.mark.redis
@pytest.mark.parametrize("driver", ["redis-py", "glide"])
def test_doctor_warns_that_a_redis_without_persistence_forgets_records(
    redis_url: str, driver: str
) -> None:
    ran = cli("doctor", "--redis", redis_url, "--driver", driver)
    assert ran.code == 0, ran.out + ran.err
    assert ran.err == ""
    assert ran.lines[0] == f"doctor: checking redis at {where(redis_url)}"
    warnings = [line for line in ran.lines if line.startswith("warning: ")]
    assert any("set appendonly yes" in line for line in warnings), ran.out
    assert not any(line.startswith("error: ") for line in ran.lines)
    assert ran.lines[-1] == (
        f"doctor: 0 errors, {len(warnings)} warning{'s' * (len(warnings) != 1)}: "
        "the store works, with the weaker guarantees above"
    )
    assert len(ran.lines) == len(warnings) + 2

    strict = cli("doctor", "--redis", redis_url, "--driver", driver, "--strict")
    assert strict.code == 1
    assert strict.lines[1:-1] == ran.lines[1:-1]
    assert strict.lines[-1].endswith(": failing on warnings (--strict)")


@pytest.mark.redis
def test_doctor_warns_about_an_evicting_redis() -> None:
    evicting = ["--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru"]
    with RedisServer(extra_args=evicting) as server:
        ran = cli("doctor", "--redis", server.url)
    assert ran.code == 0, ran.out + ran.err
    eviction = [line for line in ran.lines if "allkeys-lru" in line]
    assert len(eviction) == 1, ran.out
    assert eviction[0].startswith("warning: ")
    assert "noeviction" in eviction[0]  # what to change


@pytest.mark.redis
def test_doctor_on_a_closed_port_is_an_error() -> None:
    port = free_port()
    ran = cli("doctor", "--redis", f"redis://:s3cret@127.0.0.1:{port}/0")
    location = f"redis at 127.0.0.1:{port}/0"
    assert_unreachable(ran, location, f"error: {location} is unreachable", secret="s3cret")


@pytest.mark.redis
def test_doctor_never_prints_the_password() -> None:
    with RedisServer() as server:
        server.command("CONFIG", "SET", "requirepass", "s3cret")  # after its readiness PING
        right = cli("doctor", "--redis", f"redis://:s3cret@127.0.0.1:{server.port}/0")
        wrong = cli("doctor", "--redis", f"redis://:n0tit@127.0.0.1:{server.port}/0")
    assert right.code == 0, right.out + right.err
    assert not any(line.startswith("error: ") for line in right.lines)
    assert wrong.code == 1, wrong.out + wrong.err
    assert wrong.lines[1].startswith("error: ")
    assert "s3cret" not in right.out + right.err
    assert "n0tit" not in wrong.out + wrong.err


def test_doctor_usage_errors() -> None:
    neither = cli("doctor")
    assert neither.code == 2
    assert "no store given: pass --redis URL or --dsn" in neither.err
    both = cli("doctor", "--redis", "redis://127.0.0.1/0", "--dsn", "postgresql://localhost/x")
    assert both.code == 2
    assert "pass --redis or --dsn, not both" in both.err
    table = cli("doctor", "--redis", "redis://127.0.0.1/0", "--table", "t")
    assert table.code == 2
    assert "--table is for a PostgreSQL store" in table.err
    scheme = cli("doctor", "--redis", "http://127.0.0.1/0")
    assert scheme.code == 2
    assert "--redis: Redis URL must specify one of the following schemes" in scheme.err
    assert cli("doctor", "--redis", "redis://127.0.0.1/0", "--driver", "jedis").code == 2


@pytest.mark.parametrize(
    ("hidden", "args", "extra"),
    [
        pytest.param("asyncpg", ["migrate", "--dsn", "postgresql://x/y"], "postgres", id="migrate"),
        pytest.param("asyncpg", ["doctor", "--dsn", "postgresql://x/y"], "postgres", id="pg"),
        pytest.param("redis", ["doctor", "--redis", "redis://x"], "redis", id="redis"),
        pytest.param(
            "glide", ["doctor", "--redis", "redis://x", "--driver", "glide"], "glide", id="glide"
        ),
    ],
)
def test_a_missing_extra_is_one_line_naming_it(hidden: str, args: list[str], extra: str) -> None:
    ran = cli_without(hidden, *args)
    assert ran.code == 1
    assert ran.out == ""
    lines = ran.err.splitlines()
    assert len(lines) == 1, ran.err
    assert lines[0].startswith("starlette-idempotency: error: ")
    assert lines[0].endswith(f"pip install 'starlette-idempotency[{extra}]'")


LIBRARY = """
import asyncio
try:
    {statement}
except ImportError as exc:
    print(exc)
"""


@pytest.mark.parametrize(
    ("hidden", "statement", "extra"),
    [
        ("httpx", "from starlette_idempotency import IdempotentTransport", "client"),
        ("prometheus_client", "from starlette_idempotency import PrometheusMetrics", "prometheus"),
        (
            "redis",
            "from starlette_idempotency import RedisStore; RedisStore.from_url('redis://x')",
            "redis",
        ),
        (
            "glide",
            "from starlette_idempotency import RedisStore; "
            "RedisStore.from_url('redis://x', driver='glide')",
            "glide",
        ),
        (
            "asyncpg",
            "from starlette_idempotency import PostgresStore; "
            "asyncio.run(PostgresStore.connect('postgresql://x/y'))",
            "postgres",
        ),
    ],
    ids=["client", "prometheus", "redis", "glide", "postgres"],
)
def test_the_library_names_the_extra_a_missing_driver_is_in(
    hidden: str, statement: str, extra: str
) -> None:
    ran = run(sys.executable, "-c", HIDING + LIBRARY.format(statement=statement), hidden)
    assert ran.code == 0, ran.err
    assert ran.out.rstrip("\n").endswith(f"pip install 'starlette-idempotency[{extra}]'")
