"""Load runs: ``wrk`` against one uvicorn server, unique keys or one replayed key."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench.requests import BODY, PAYMENT_PATH
from bench.servers import Services, UvicornServer, machine_cpu, process_times

Mode = Literal["unique", "replay"]
MODES: tuple[Mode, ...] = ("unique", "replay")
LUA_DIR = Path(__file__).resolve().parent / "lua"
_MARKER = "BENCH_RESULT "


@dataclass(frozen=True, slots=True)
class LoadSettings:
    duration: float
    connections: int = 32
    threads: int = 2
    warmup: float = 1.0
    timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    errors: int  # socket errors, timeouts and responses with status > 399

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
    duplicates: int  # handler executions beyond one per key: must be 0 under any layer
    server_cpu_us: float  # uvicorn's CPU time per answered request
    server_system_us: float  # of it, in the kernel: system calls, waking what it writes to
    store_cpu_us: float  # the Redis / PostgreSQL processes' CPU time per answered request
    foreign_cpu_pct: float  # CPU used by processes outside this benchmark, % of the machine
    collector_us: float  # the worker's time in the cyclic garbage collector per answered request
    collections_per_1k: tuple[float, ...]  # its collections by generation per 1,000 requests


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if found is None:
        raise SystemExit("wrk is not installed: apt-get update && apt-get install -y wrk")
    return found


def run_wrk(port: int, mode: Mode, argument: str, settings: LoadSettings) -> WrkResult:
    """Run wrk once for ``settings.duration`` seconds: ``lua/unique.lua`` sends a new key per
    request (``argument`` is the run id), ``lua/replay.lua`` one completed key (``argument``)."""
    command = [
        wrk_binary(),
        f"-t{settings.threads}",
        f"-c{settings.connections}",
        f"-d{max(1, round(settings.duration))}s",
        f"--timeout={settings.timeout:g}s",
        "--latency",
        *("-s", str(LUA_DIR / f"{mode}.lua")),
        f"http://127.0.0.1:{port}{PAYMENT_PATH}",
        *("--", argument, BODY.decode()),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=settings.duration + 60, check=False
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(_MARKER)), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    data = json.loads(line.removeprefix(_MARKER))
    return WrkResult(
        requests=int(data["requests"]),
        duration_s=int(data["duration_us"]) / 1e6,
        p50_ms=int(data["p50_us"]) / 1000,
        p99_ms=int(data["p99_us"]) / 1000,
        errors=sum(int(count) for count in data["errors"].values()),
    )


def _wrk_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def warm_up(server: UvicornServer, run_id: str, settings: LoadSettings) -> None:
    """Fresh keys through wrk for ``settings.warmup`` seconds (none when it is 0)."""
    if settings.warmup > 0:
        run_wrk(server.port, "unique", f"{run_id}-warm", LoadSettings(settings.warmup))


def argument_for(server: UvicornServer, run_id: str, mode: Mode) -> str:
    """What wrk's script of ``mode`` takes: a run id, or a key completed once and replayed
    once (what every request of a replay run sends)."""
    if mode == "unique":
        return f"{run_id}-u"
    key = f"{run_id}-replayed"
    for attempt in (1, 2):
        status, body = server.post(key)
        if status != 201:
            config = server.settings.config
            raise RuntimeError(f"{config}: POST #{attempt} answered {status}: {body!r}")
    return key


def measure(
    server: UvicornServer,
    services: Services,
    round_number: int,
    run_id: str,
    settings: LoadSettings,
    modes: tuple[Mode, ...] = MODES,
) -> list[RunResult]:
    """Each mode on one server, after a warm-up: wrk's figures and who used the CPU meanwhile."""
    results: list[RunResult] = []
    warm_up(server, run_id, settings)
    for mode in modes:
        argument = argument_for(server, run_id, mode)
        before = server.executions()
        user, system = process_times(server.pid)
        store_cpu, wrk_cpu = services.store_cpu(), _wrk_cpu()
        busy_before, total_before = machine_cpu()
        wrk = run_wrk(server.port, mode, argument, settings)
        busy_after, total_after = machine_cpu()
        user_after, system_after = process_times(server.pid)
        server_cpu = user_after + system_after - user - system
        store_cpu = services.store_cpu() - store_cpu
        busy = busy_after - busy_before - server_cpu - store_cpu - (_wrk_cpu() - wrk_cpu)
        capacity = total_after - total_before or wrk.duration_s * (os.cpu_count() or 1)
        after = server.executions()
        answered = max(1, wrk.requests)
        executions = after.executions - before.executions
        results.append(
            RunResult(
                config=server.settings.config,
                mode=mode,
                round=round_number,
                wrk=wrk,
                duplicates=executions - (after.distinct_keys - before.distinct_keys),
                server_cpu_us=server_cpu / answered * 1e6,
                server_system_us=(system_after - system) / answered * 1e6,
                store_cpu_us=store_cpu / answered * 1e6,
                foreign_cpu_pct=100 * max(0.0, busy) / capacity,
                collector_us=(after.collector_seconds - before.collector_seconds) / answered * 1e6,
                collections_per_1k=tuple(
                    (now - then) * 1000 / answered
                    for now, then in zip(after.collections, before.collections, strict=True)
                ),
            )
        )
    return results
