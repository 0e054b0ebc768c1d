"""Processes the benchmark starts: private Redis and PostgreSQL servers, and uvicorn.

Every server runs on a free loopback port and is waited for by polling (never a fixed sleep).
The shared Redis and PostgreSQL of the machine are never touched: a run starts its own
throwaway servers (``starlette_idempotency.testing``) and flushes only those.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.app import AppSettings
from bench.gcwatch import GcSnapshot
from bench.requests import (
    EXECUTIONS_PATH,
    GC_PATH,
    PAYMENT_PATH,
    PREFILL_PATH,
    REQUEST_BODIES,
    REQUEST_BODY,
)
from starlette_idempotency.testing._processes import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
_START_TIMEOUT = 30.0
_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def child_pids(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(entry.name))
    return children


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores together.

    *busy* is user + nice + system time, the time charged to processes; interrupt and
    softirq time (loopback networking) is left out, as no process is charged for it.
    """
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = values[0] + values[1] + values[2]
    total = sum(values[:8])  # guest time is already in user
    return busy / _TICKS, total / _TICKS


def http_request(
    port: int,
    method: str,
    path: str,
    *,
    key: str | None = None,
    timeout: float = 5.0,
    body: bytes = REQUEST_BODY,
) -> tuple[int, bytes]:
    """One request to ``127.0.0.1:port`` on a fresh connection: (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json"} if method == "POST" else {}
        if key is not None:
            headers["Idempotency-Key"] = key
        connection.request(method, path, body=body if method == "POST" else None, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@dataclass(frozen=True, slots=True)
class Executions:
    executions: int
    distinct_keys: int


class UvicornServer:
    """uvicorn (uvloop, httptools, no access log) serving one configuration: one worker, or
    ``workers`` processes behind one port (then ``pid``, the CPU and the RSS are the
    supervisor's, and the execution counters one worker's)."""

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
            sys.executable,
            "-m",
            "uvicorn",
            "bench.app:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
            *(["--workers", str(self.workers)] if self.workers > 1 else []),
        ]
        env = {**_base_env(), **self.settings.to_env()}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            wait_until(self._ready, timeout=_START_TIMEOUT, what=f"uvicorn on {self.port}")
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
        status, body = http_request(self.port, "GET", EXECUTIONS_PATH)
        if status != 200:
            raise RuntimeError(f"GET {EXECUTIONS_PATH} answered {status}")
        data = json.loads(body)
        return Executions(int(data["executions"]), int(data["distinct_keys"]))

    def settled_executions(self, timeout: float = 10.0) -> Executions:
        """The counters once they stop moving (requests cut off by wrk may still be running)."""
        last = self.executions()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            current = self.executions()
            if current == last:
                return current
            last = current
        return last

    def post(self, key: str) -> tuple[int, bytes]:
        body = REQUEST_BODIES[self.settings.app]
        return http_request(self.port, "POST", PAYMENT_PATH, key=key, body=body)

    def gc_snapshot(self) -> GcSnapshot:
        """The server's garbage-collector counters so far (:mod:`bench.gcwatch`)."""
        status, body = http_request(self.port, "GET", GC_PATH)
        if status != 200:
            raise RuntimeError(f"GET {GC_PATH} answered {status}")
        return GcSnapshot.from_json(json.loads(body))

    def prefill(self, records: int) -> dict[str, Any]:
        """Fill the server's MemoryStore with ``records`` live records (:mod:`bench.prefill`)."""
        status, body = http_request(self.port, "GET", f"{PREFILL_PATH}?n={records}", timeout=600)
        if status != 200:
            raise RuntimeError(f"GET {PREFILL_PATH} answered {status}: {body[:300]!r}")
        result: dict[str, Any] = json.loads(body)
        return result

    def rss_kib(self) -> int:
        """The server's resident set size (VmRSS) in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

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


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@dataclass
class Services:
    """The private servers of one run (``None`` when the run needs none)."""

    redis_url: str | None = None
    redis_port: int | None = None
    postgres_dsn: str | None = None
    redis_version: str = "not started"
    postgres_version: str = "not started"
    postgres_settings: str = ""
    redis_pid: int | None = None
    postgres_pid: int | None = None  # the postmaster

    def store_cpu(self) -> dict[int, float]:
        """CPU seconds so far of every store process (Redis, the postmaster and its children)."""
        pids = [pid for pid in (self.redis_pid, self.postgres_pid) if pid is not None]
        if self.postgres_pid is not None:
            pids += child_pids(self.postgres_pid)
        return {pid: process_cpu(pid) for pid in pids}

    def flush_redis(self) -> None:
        """Empty the private Redis between runs (it belongs to this benchmark alone)."""
        if self.redis_port is not None:
            from starlette_idempotency.testing._redis_server import redis_command

            redis_command(self.redis_port, "FLUSHALL")

    def truncate_postgres(self, table: str) -> None:
        if self.postgres_dsn is not None:
            asyncio.run(_truncate(self.postgres_dsn, table))


async def _truncate(dsn: str, table: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    connection: Any = await asyncpg.connect(dsn)
    try:
        exists = await connection.fetchval("SELECT to_regclass($1) IS NOT NULL", table)
        if exists:
            await connection.execute(f'TRUNCATE "{table}"')
    finally:
        await connection.close()


def _read_text(path: str) -> str:
    return Path(path).read_text()


async def _postgres_version(dsn: str) -> tuple[str, str, int]:
    import asyncpg

    connection: Any = await asyncpg.connect(dsn)
    try:
        backend = int(await connection.fetchval("SELECT pg_backend_pid()"))
        stat = await asyncio.to_thread(_read_text, f"/proc/{backend}/stat")
        postmaster = int(stat.rsplit(")", 1)[1].split()[1])
        version = await connection.fetchval("SHOW server_version")
        rows = await connection.fetch(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('fsync', 'synchronous_commit', 'full_page_writes', 'shared_buffers') ORDER BY name"
        )
    finally:
        await connection.close()
    settings = ", ".join(f"{row['name']}={row['setting']}" for row in rows)
    return str(version), settings, postmaster


@contextlib.contextmanager
def private_services(*, redis: bool, postgres: bool) -> Iterator[Services]:
    """Start the private servers the selected configurations need; stop them afterwards."""

    with contextlib.ExitStack() as stack:
        services = Services()
        if redis:
            from starlette_idempotency.testing._redis_server import RedisServer, redis_command

            server = stack.enter_context(RedisServer())
            services.redis_url, services.redis_port = server.url, server.port
            info = redis_command(server.port, "INFO", "server").decode(errors="replace")
            fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
            services.redis_version = fields.get("redis_version", "unknown").strip()
            services.redis_pid = int(fields["process_id"])
        if postgres:
            from starlette_idempotency.testing._postgres_server import PostgresServer

            pg = stack.enter_context(PostgresServer())
            services.postgres_dsn = pg.dsn
            version, settings, postmaster = asyncio.run(_postgres_version(pg.dsn))
            services.postgres_version, services.postgres_settings = version, settings
            services.postgres_pid = postmaster
        yield services
