"""Processes the benchmark starts: private Redis and PostgreSQL servers, and uvicorn.

Every server runs on a free loopback port and is waited for by polling (never a fixed sleep).
The shared Redis and PostgreSQL of the machine are never touched: a run starts its own
throwaway servers and flushes only those.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.app import AppSettings
from bench.requests import BODY, EXECUTIONS_PATH, PAYMENT_PATH
from starlette_idempotency.testing._processes import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
_TICKS = os.sysconf("SC_CLK_TCK")


def process_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process ((0, 0) once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (0 once it is gone)."""
    return sum(process_times(pid))


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores together: busy is
    user + nice + system time, what processes are charged for."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (values[0] + values[1] + values[2]) / _TICKS, sum(values[:8]) / _TICKS


def http_request(
    port: int, method: str, path: str, *, key: str | None = None, timeout: float = 5.0
) -> tuple[int, bytes]:
    """One request to ``127.0.0.1:port`` on a fresh connection: (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if method == "POST" else {}
        if key is not None:
            headers["Idempotency-Key"] = key
        connection.request(method, path, body=BODY if method == "POST" else None, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@dataclass(frozen=True, slots=True)
class Executions:
    executions: int
    distinct_keys: int
    # The worker's collector, for its whole life: not part of "the counters stopped moving".
    collections: tuple[int, ...] = field(default=(0, 0, 0), compare=False)
    collector_seconds: float = field(default=0.0, compare=False)


class UvicornServer:
    """uvicorn (uvloop, httptools, no access log) serving one configuration: one worker, or
    ``workers`` processes behind one port (then ``pid`` is the supervisor's)."""

    def __init__(self, settings: AppSettings, log_path: Path, *, workers: int = 1) -> None:
        self.settings = settings
        self.port = free_port()
        self.log_path = log_path
        self.workers = workers
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def start(self) -> UvicornServer:
        command = [
            *(sys.executable, "-m", "uvicorn", "bench.app:create_app", "--factory"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--loop", "uvloop", "--http", "httptools", "--no-access-log"),
            *("--log-level", "warning"),
            *(["--workers", str(self.workers)] if self.workers > 1 else []),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**env, **self.settings.to_env()},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_until(self._ready, timeout=30, what=f"uvicorn on {self.port}")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            log = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"uvicorn ({self.settings.config}) exited early:\n{log}")
        try:
            status, _ = http_request(self.port, "GET", EXECUTIONS_PATH, timeout=0.5)
        except OSError:
            return False
        return status == 200

    def executions(self) -> Executions:
        """The handler's counters once they stop moving (requests cut off by wrk may still be
        running)."""

        def read() -> Executions:
            status, body = http_request(self.port, "GET", EXECUTIONS_PATH)
            if status != 200:
                raise RuntimeError(f"GET {EXECUTIONS_PATH} answered {status}")
            data = json.loads(body)
            return Executions(
                int(data["executions"]),
                int(data["distinct_keys"]),
                tuple(data["collections"]),
                float(data["collector_seconds"]),
            )

        last, deadline = read(), time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.2)
            current = read()
            if current == last:
                break
            last = current
        return last

    def post(self, key: str) -> tuple[int, bytes]:
        return http_request(self.port, "POST", PAYMENT_PATH, key=key)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)

    def __enter__(self) -> UvicornServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


@dataclass
class Services:
    """The private servers of one run (``None`` when the run needs none)."""

    redis_url: str | None = None
    redis_port: int | None = None
    postgres_dsn: str | None = None
    store_pids: tuple[int, ...] = ()  # redis-server, the postmaster

    def store_cpu(self) -> float:
        """CPU seconds so far of the store processes (the postmaster's children included)."""
        children = {
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _parent(int(entry.name)) in self.store_pids
        }
        return sum(process_cpu(pid) for pid in {*self.store_pids, *children})

    def reset(self, pg_table: str = "bench_idempotency") -> None:
        """Empty the private stores between runs (they belong to this benchmark alone)."""
        if self.redis_port is not None:
            from starlette_idempotency.testing._redis_server import redis_command

            redis_command(self.redis_port, "FLUSHALL")
        if self.postgres_dsn is not None:
            asyncio.run(_postgres(self.postgres_dsn, f'DROP TABLE IF EXISTS "{pg_table}"'))


async def _postgres(dsn: str, statement: str) -> Any:
    import asyncpg  # type: ignore[import-untyped]

    connection: Any = await asyncpg.connect(dsn)
    try:
        return await connection.fetchval(statement)
    finally:
        await connection.close()


@contextlib.contextmanager
def private_services(*, redis: bool, postgres: bool) -> Iterator[Services]:
    """Start the private servers the selected configurations need; stop them afterwards."""
    with contextlib.ExitStack() as stack:
        services = Services()
        if redis:
            from starlette_idempotency.testing._redis_server import RedisServer

            server = stack.enter_context(RedisServer())
            services.redis_url, services.redis_port = server.url, server.port
            assert server.pid is not None
            services.store_pids += (server.pid,)
        if postgres:
            from starlette_idempotency.testing._postgres_server import PostgresServer

            pg = stack.enter_context(PostgresServer())
            services.postgres_dsn = pg.dsn
            backend = int(asyncio.run(_postgres(pg.dsn, "SELECT pg_backend_pid()")))
            services.store_pids += (_parent(backend),)
        yield services
