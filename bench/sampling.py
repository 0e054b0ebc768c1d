"""Where the worker's CPU goes under load: py-spy samples of the uvicorn worker under wrk.

For each configuration and mode, one server is loaded by wrk while ``py-spy record -f raw``
samples its process (``--full-filenames``). ``--gil`` keeps only the samples where the worker
holds the GIL: uvloop releases it while the loop waits for I/O, so a wait for Redis, or for a
core on a busy machine, is never charged to the code that was last on the stack.
The worker is stopped for each sample, py-spy's default: ``--nonblocking`` reads the stack
while the worker runs on, and on Python 3.11 that read tears. Frames that return free their
slots for the next call, so the innermost frames read are mostly another moment's: on a
MemoryStore new key, 164 of 171 samples of five functions that each have one caller showed
them under a function that never calls them. Stopped, none did. A stopped worker runs about a
third slower and a sample can land late, at the next line that makes a system call (on this VM,
2.6 % of a MemoryStore new key's samples fell on the lines asking for the running loop, which
call ``getpid`` on 3.11): read the rows as shares of their total.
A sample is charged to the package whose file its innermost Python frame is in (a C function
called from Python, ``orjson.dumps`` say, counts for the Python code that called it), and the
counts become self time per request: samples / rate / (wrk's rate * the sampled seconds).
``python -m bench --skip-load --skip-micro --skip-ablation`` runs this section alone; the raw
stacks are kept under ``bench/results/`` for flame graphs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.load import LoadSettings, Mode, WrkResult, argument_for, run_wrk, warm_up
from bench.servers import UvicornServer

# Where a frame's file lies decides its package; the first fragment found wins (the
# library's own ``stores/redis/`` before redis-py's ``/redis/``).
AREAS: tuple[tuple[str, str], ...] = (
    ("/starlette_idempotency/", "ours"),
    ("/mobius_idempotence/", "mobius"),
    ("/idempotency_header_middleware/", "aih"),
    ("/idemkit/", "idemkit"),
    ("/idemgate/", "idemgate"),
    ("/bench/", "bench app"),
    ("/fastapi/", "fastapi"),
    ("/starlette/", "starlette"),
    ("/pydantic", "pydantic"),
    ("/redis/", "redis-py"),
    ("/glide", "valkey-glide"),
    ("/asyncpg/", "asyncpg"),
    ("/uvicorn/", "uvicorn"),
    ("/asyncio/", "asyncio"),
)
OTHER = "other"
_FILE = re.compile(r"\(([^()]*?)(?::\d+)?\)$")
_SAMPLED = re.compile(r"Samples: (\d+) Errors: (\d+)")


def area_of(filename: str) -> str:
    return next((area for mark, area in AREAS if mark in filename), OTHER)


@dataclass(frozen=True, slots=True)
class SelfTime:
    """Self CPU time per request, in µs, by package (:data:`AREAS`), under wrk."""

    config: str
    mode: Mode
    samples: int
    us_by_area: dict[str, float]
    rps: float

    @property
    def total_us(self) -> float:
        return sum(self.us_by_area.values())


def py_spy() -> str:
    """The py-spy of this environment (the bench group installs it), else one on PATH."""
    found = shutil.which("py-spy", path=os.pathsep.join([sys.prefix + "/bin", os.defpath]))
    found = found or shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed: task bench installs it (the bench group)")
    return found


def leaf_areas(raw: str) -> Counter[str]:
    """Samples by the package of their innermost frame, from py-spy's raw (folded) output."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        found = _FILE.search(stack.rpartition(";")[2])
        counts[area_of(found.group(1)) if found else OTHER] += int(count)
    return counts


def sample(
    server: UvicornServer,
    run_id: str,
    mode: Mode,
    settings: LoadSettings,
    *,
    rate: int,
    raw_path: Path,
) -> SelfTime:
    """Sample the worker for the middle of one wrk run (from 1 s in to 1 s before its end)."""
    if settings.duration < 3:
        raise SystemExit("sampling needs wrk runs of 3 s or more")
    warm_up(server, run_id, settings)
    argument = argument_for(server, run_id, mode)
    loads: list[WrkResult] = []
    load = threading.Thread(
        target=lambda: loads.append(run_wrk(server.port, mode, argument, settings))
    )
    load.start()
    seconds = settings.duration - 2
    try:
        time.sleep(1)  # wrk's connections are up and the loop is busy
        done = subprocess.run(
            [
                *(py_spy(), "record", "--format", "raw", "--full-filenames", "--gil"),
                *("--rate", str(rate), "--duration", f"{seconds:g}"),
                *("--pid", str(server.pid), "--output", str(raw_path)),
            ],
            capture_output=True,
            text=True,
            timeout=settings.duration + 60,
            check=False,
        )
    finally:
        load.join()
    if done.returncode != 0 or not loads:
        raise RuntimeError(f"py-spy failed ({done.returncode}): {done.stderr[-2000:]}")
    counts = leaf_areas(raw_path.read_text())
    requests = loads[0].rps * seconds
    tally = _SAMPLED.search(done.stdout + done.stderr)
    if tally is None or int(tally[1]) == 0:
        raise RuntimeError(f"py-spy read no samples: {done.stderr[-2000:]}")
    per_sample = 1 / rate / requests * 1e6
    return SelfTime(
        config=server.settings.config,
        mode=mode,
        samples=sum(counts.values()),
        us_by_area={area: n * per_sample for area, n in counts.most_common()},
        rps=loads[0].rps,
    )


def table(results: list[SelfTime], rate: int) -> str:
    """Self µs per request by package, one row per configuration and mode."""
    seen = {area for result in results for area in result.us_by_area}
    areas = [area for _, area in AREAS if area in seen] + ([OTHER] if OTHER in seen else [])
    lines = [
        f"Self CPU µs per request by package (py-spy --gil, {rate} Hz):",
        "",
        "| config | mode | req/s | " + " | ".join(areas) + " | total |",
        "|---|---|---|" + "---|" * (len(areas) + 1),
    ]
    for result in results:
        cells = [f"{result.us_by_area.get(area, 0.0):.1f}" for area in areas]
        lines.append(
            f"| {result.config} | {result.mode} | {result.rps:,.0f} | "
            + " | ".join(cells)
            + f" | {result.total_us:.1f} |"
        )
    return "\n".join(lines)
