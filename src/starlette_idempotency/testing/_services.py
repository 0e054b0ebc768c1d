"""Where the test fixtures get a Redis and a PostgreSQL from.

Three sources, taken in this order:

1. the environment: ``REDIS_URL`` / ``DATABASE_URL`` name a server you run, used as it is;
2. testcontainers (the ``testcontainers`` extra), when it is installed and a Docker engine
   answers: a container started for the test run;
3. a throwaway local server (``redis-server``; ``initdb`` + ``pg_ctl``) from
   :mod:`.redis_server` and :mod:`.postgres_server`.

:func:`choose_source` decides from injected :class:`Probes`, so the decision is tested without
Docker; :func:`redis_service` and :func:`postgres_service` start what it chose::

    with redis_service(choose_source(REDIS_ENV, machine_probes(REDIS_CONTAINERS))) as url:
        ...
"""

from __future__ import annotations

import contextlib
import enum
import gc
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette_idempotency.testing._postgres_server import PostgresServer
from starlette_idempotency.testing._processes import Managed
from starlette_idempotency.testing._redis_server import RedisServer

# Named for the public package, as httpx names its loggers, not for this private module.
logger = logging.getLogger("starlette_idempotency.testing")

_Server = TypeVar("_Server", bound=Managed)

REDIS_ENV = "REDIS_URL"
DATABASE_ENV = "DATABASE_URL"
#: The modules of testcontainers' container classes, newest layout first: 4.15 moved them
#: under ``testcontainers.community`` and the old modules warn on import.
REDIS_CONTAINERS = ("testcontainers.community.redis", "testcontainers.redis")
POSTGRES_CONTAINERS = ("testcontainers.community.postgres", "testcontainers.postgres")
#: The images testcontainers runs (override the ``redis_url`` / ``postgres_admin_dsn`` fixture
#: for others).
REDIS_IMAGE = "redis:7-alpine"
POSTGRES_IMAGE = "postgres:16-alpine"
DOCKER_PING_TIMEOUT = 3.0


class Source(enum.Enum):
    """Where a service comes from."""

    ENVIRONMENT = "environment"
    TESTCONTAINERS = "testcontainers"
    LOCAL = "local"


@dataclass(frozen=True, slots=True)
class Choice:
    """What :func:`choose_source` decided, and why (``reason`` is for messages and logs)."""

    source: Source
    env_var: str
    reason: str
    url: str | None = None
    """The environment's URL, for :attr:`Source.ENVIRONMENT`."""


@dataclass(frozen=True, slots=True)
class Probes:
    """How :func:`choose_source` looks at the machine.

    Each probe is called at most once, and only when the steps before it did not decide: a run
    with the URL set never imports Docker's client nor waits for an engine.
    """

    environ: Mapping[str, str]
    testcontainers_installed: Callable[[], bool]
    docker_answers: Callable[[], bool]


def choose_source(env_var: str, probes: Probes) -> Choice:
    """The environment URL in ``env_var`` when set (and not blank), else testcontainers when
    it is installed and a Docker engine answers, else a local throwaway server."""
    url = probes.environ.get(env_var, "").strip()
    if url:
        return Choice(Source.ENVIRONMENT, env_var, f"{env_var} is set", url)
    if not probes.testcontainers_installed():
        return Choice(
            Source.LOCAL, env_var, f"{env_var} is not set and testcontainers is not installed"
        )
    if not probes.docker_answers():
        return Choice(Source.LOCAL, env_var, f"{env_var} is not set and no Docker engine answers")
    return Choice(Source.TESTCONTAINERS, env_var, f"{env_var} is not set and Docker answers")


def module_installed(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it, beyond its parent packages)."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: imports of it are blocked
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def docker_engine_answers(timeout: float = DOCKER_PING_TIMEOUT) -> bool:
    """Whether a Docker engine answers a ping where testcontainers looks for one
    (``DOCKER_HOST``, else the default socket), through Docker's Python client."""
    # Docker's client leaves the socket of a failed connection open (docker 7.1): it is closed
    # when collected here, and its ResourceWarning must not fail a test run that turns warnings
    # into errors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            return _ping_docker(timeout)
        finally:
            gc.collect()


def _ping_docker(timeout: float) -> bool:
    try:
        client = importlib.import_module("docker").from_env(timeout=timeout)
    except Exception:  # no client library, no socket, no engine: all mean "no Docker"
        return False
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def machine_probes(container_modules: Sequence[str]) -> Probes:
    """Probes of this process's environment, for one service's testcontainers modules."""
    return Probes(
        environ=os.environ,
        testcontainers_installed=lambda: any(map(module_installed, container_modules)),
        docker_answers=docker_engine_answers,
    )


def _containers(modules: Sequence[str]) -> Any:
    """The first of ``modules`` that is installed, imported."""
    found = next((name for name in modules if module_installed(name)), modules[-1])
    return importlib.import_module(found)


@contextlib.contextmanager
def _local(choice: Choice, start: Callable[[], _Server]) -> Iterator[_Server]:
    """Start a local server, or say every way of getting one when its binaries are missing."""
    try:
        server = start()
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{exc} (a local server was chosen because {choice.reason}); or set {choice.env_var} "
            "to a running server, or install starlette-idempotency[testcontainers] and start "
            "a Docker engine"
        ) from exc
    with server as running:
        yield running


@contextlib.contextmanager
def redis_service(choice: Choice) -> Iterator[str]:
    """The URL of a Redis from ``choice``'s source, running until the block ends."""
    logger.info("Redis for the tests: %s (%s)", choice.source.value, choice.reason)
    if choice.source is Source.ENVIRONMENT:
        assert choice.url is not None
        yield choice.url
    elif choice.source is Source.TESTCONTAINERS:
        with _containers(REDIS_CONTAINERS).RedisContainer(REDIS_IMAGE) as container:
            host = container.get_container_host_ip()
            yield f"redis://{host}:{container.get_exposed_port(6379)}/0"
    else:
        with _local(choice, RedisServer) as server:
            yield server.url


@contextlib.contextmanager
def postgres_service(choice: Choice) -> Iterator[str]:
    """A DSN of a PostgreSQL from ``choice``'s source, as a user allowed to create databases,
    running until the block ends."""
    logger.info("PostgreSQL for the tests: %s (%s)", choice.source.value, choice.reason)
    if choice.source is Source.ENVIRONMENT:
        assert choice.url is not None
        yield choice.url
    elif choice.source is Source.TESTCONTAINERS:
        # driver=None: a plain postgresql:// URL, not SQLAlchemy's postgresql+psycopg2://
        with _containers(POSTGRES_CONTAINERS).PostgresContainer(
            POSTGRES_IMAGE, driver=None
        ) as container:
            yield str(container.get_connection_url())
    else:
        with _local(choice, PostgresServer) as server:
            yield server.dsn


__all__ = [
    "DATABASE_ENV",
    "POSTGRES_CONTAINERS",
    "POSTGRES_IMAGE",
    "REDIS_CONTAINERS",
    "REDIS_ENV",
    "REDIS_IMAGE",
    "Choice",
    "Probes",
    "Source",
    "choose_source",
    "docker_engine_answers",
    "machine_probes",
    "module_installed",
    "postgres_service",
    "redis_service",
]
