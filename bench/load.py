"""Load runs: ``wrk`` against one uvicorn server, unique keys or one replayed key."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bench.configs import AppName
from bench.gcwatch import GcSnapshot
from bench.requests import REQUEST_BODIES
from bench.servers import Services, UvicornServer, machine_cpu, process_cpu

Mode = Literal["unique", "replay"]
MODES: tuple[Mode, ...] = ("unique", "replay")
LUA_DIR = Path(__file__).resolve().parent / "lua"
_MARKER = "BENCH_RESULT "


@dataclass(frozen=True, slots=True)
class LoadSettings:
    duration: float
    connections: int
    threads: int
    warmup: float
    timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors_socket: int  # connect + read + write + timeout
    errors_status: int  # responses with status > 399 (wrk's "Non-2xx or 3xx")
    keys_issued: int
    max_ms: float = 0.0

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


@dataclass(frozen=True, slots=True)
class RunResult:
    """One measured wrk run against one server, with the server's own counters."""

    config: str
    mode: Mode
    round: int
    wrk: WrkResult
    executions: int  # handler executions during the run
    distinct_keys: int  # distinct keys the handler saw during the run
    rss_kib: int  # the server's VmRSS after the run
    server_cpu_us: float  # uvicorn's CPU time per answered request
    store_cpu_us: float  # Redis / PostgreSQL processes' CPU time per answered request
    wrk_cpu_pct: float  # wrk's CPU use, in % of the whole machine
    foreign_cpu_pct: float  # CPU used by processes outside this benchmark, % of the machine
    app: AppName = "plain"
    gc: GcSnapshot = field(default_factory=GcSnapshot)  # the server's collections in the run
    prefilled: int = 0  # live records put in the store before the load (bench.prefill)

    @property
    def duplicates(self) -> int:
        """Executions beyond one per key (must be 0 under any idempotency layer)."""
        return self.executions - self.distinct_keys


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise FileNotFoundError("wrk is not installed: apt-get update && apt-get install -y wrk")
    return found


def wrk_version() -> str:
    done = subprocess.run([wrk_binary(), "--version"], capture_output=True, text=True, check=False)
    return (
        (done.stdout or done.stderr).splitlines()[0].strip() if done.stdout or done.stderr else ""
    )


def run_wrk(
    port: int,
    mode: Mode,
    argument: str,
    *,
    duration: float,
    settings: LoadSettings,
    body: bytes | None = None,
) -> tuple[WrkResult, str]:
    """Run wrk once (``body``: the POST body, else the ``plain`` app's); the parsed result and
    wrk's full output."""
    command = [
        wrk_binary(),
        f"-t{settings.threads}",
        f"-c{settings.connections}",
        f"-d{max(1, round(duration))}s",
        f"--timeout={settings.timeout:g}s",
        "--latency",
        "-s",
        str(LUA_DIR / f"{mode}.lua"),
        f"http://127.0.0.1:{port}/payments",
        "--",
        argument,
        *([body.decode()] if body is not None else []),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=duration + 60, check=False
    )
    output = done.stdout + done.stderr
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(_MARKER)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{output}")
    data = json.loads(line[len(_MARKER) :])
    errors = data["errors"]
    result = WrkResult(
        requests=int(data["requests"]),
        duration_s=int(data["duration_us"]) / 1e6,
        p50_ms=int(data["p50_us"]) / 1000,
        p90_ms=int(data["p90_us"]) / 1000,
        p99_ms=int(data["p99_us"]) / 1000,
        errors_socket=sum(int(errors[name]) for name in ("connect", "read", "write", "timeout")),
        errors_status=int(errors["status"]),
        keys_issued=int(data["keys_issued"]),
        max_ms=int(data.get("max_us", 0)) / 1000,
    )
    return result, output


@dataclass(frozen=True, slots=True)
class CpuUse:
    server_s: float
    store_s: float
    wrk_s: float
    foreign_s: float
    capacity_s: float  # wall time x cores


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_wrk(
    server: UvicornServer, services: Services, mode: Mode, argument: str, settings: LoadSettings
) -> tuple[WrkResult, CpuUse]:
    """One wrk run, with the CPU time each party used during it."""
    server_before, store_before = process_cpu(server.pid), services.store_cpu()
    busy_before, total_before = machine_cpu()
    wrk_before = _children_cpu()
    started = time.monotonic()
    body = REQUEST_BODIES[server.settings.app]
    wrk, _ = run_wrk(
        server.port, mode, argument, duration=settings.duration, settings=settings, body=body
    )
    elapsed = time.monotonic() - started
    wrk_cpu = _children_cpu() - wrk_before
    busy_after, total_after = machine_cpu()
    server_cpu = process_cpu(server.pid) - server_before
    store_after = services.store_cpu()
    store_cpu = sum(cpu - store_before.get(pid, 0.0) for pid, cpu in store_after.items())
    busy = busy_after - busy_before
    capacity = (total_after - total_before) or elapsed * (os.cpu_count() or 1)
    foreign = max(0.0, busy - server_cpu - store_cpu - wrk_cpu)
    return wrk, CpuUse(server_cpu, store_cpu, wrk_cpu, foreign, capacity)


def warm_up(server: UvicornServer, run_id: str, settings: LoadSettings) -> None:
    """Fresh keys through wrk for ``settings.warmup`` seconds (none when it is 0)."""
    if settings.warmup > 0:
        run_wrk(
            server.port,
            "unique",
            f"{run_id}-warm",
            duration=settings.warmup,
            settings=settings,
            body=REQUEST_BODIES[server.settings.app],
        )


def replayed_key(server: UvicornServer, run_id: str) -> str:
    """A key completed once and replayed once: what the replay mode sends."""
    key = f"{run_id}-replayed"
    for attempt in range(2):  # the first completes the key, the second must replay
        status, body = server.post(key)
        if status != 201:
            raise RuntimeError(
                f"{server.settings.config}: pre-warm POST #{attempt + 1} answered {status}: "
                f"{body[:200]!r}"
            )
    return key


def measure(
    server: UvicornServer,
    services: Services,
    config: str,
    round_number: int,
    run_id: str,
    settings: LoadSettings,
    *,
    prefilled: int = 0,
    modes: tuple[Mode, ...] = MODES,
) -> list[RunResult]:
    """Warm the server up, then measure the unique-key mode and the replay mode on it."""
    results: list[RunResult] = []
    warm_up(server, run_id, settings)
    for mode in modes:
        argument = replayed_key(server, run_id) if mode == "replay" else f"{run_id}-u"
        before = server.settled_executions()
        gc_before = server.gc_snapshot()
        wrk, cpu = measured_wrk(server, services, mode, argument, settings)
        gc_after = server.gc_snapshot()
        after = server.settled_executions()
        answered = max(1, wrk.requests)
        results.append(
            RunResult(
                config=config,
                mode=mode,
                round=round_number,
                wrk=wrk,
                executions=after.executions - before.executions,
                distinct_keys=after.distinct_keys - before.distinct_keys,
                rss_kib=server.rss_kib(),
                server_cpu_us=cpu.server_s / answered * 1e6,
                store_cpu_us=cpu.store_s / answered * 1e6,
                wrk_cpu_pct=100 * cpu.wrk_s / cpu.capacity_s,
                foreign_cpu_pct=100 * cpu.foreign_s / cpu.capacity_s,
                app=server.settings.app,
                gc=gc_after.since(gc_before),
                prefilled=prefilled,
            )
        )
    return results
