"""``python -m bench``: run the sections, print a compact markdown summary.

The summary goes to stdout and to ``bench/results/<UTC time>.md`` beside the raw figures
(``.json``) and py-spy's stacks; ``bench/results/`` is not committed. The figures that matter
are copied into docs/explanation/benchmarks.md by hand, with the command that produced them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from bench import ablation, collector, micro, sampling
from bench.app import AppSettings
from bench.configs import BY_NAME, CONFIGS, Config, floor_of, installed, select
from bench.load import MODES, LoadSettings, Mode, RunResult, measure, wrk_binary
from bench.servers import ROOT, Services, UvicornServer, private_services

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLED = ("bare", "ours-memory", "ours-redis", *(c.name for c in CONFIGS if c.kind == "peer"))
PEERS = ("mobius", "idemkit", "idemgate", "aih")
_VERSIONS = ("starlette", "fastapi", "redis", "uvicorn", "uvloop", "orjson")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    names = ", ".join(BY_NAME)
    parser.add_argument("--configs", help=f"comma-separated subset of: {names}")
    parser.add_argument("--modes", default="unique,replay", help="unique, replay or both")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=10, help="seconds per wrk run")
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up per server")
    parser.add_argument(
        "--sample-configs",
        help=f"configurations py-spy samples (default: {', '.join(SAMPLED)}, those selected)",
    )
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--micro-requests", type=int, default=2000, help="requests per trial")
    parser.add_argument("--micro-trials", type=int, default=7, help="in-process trials")
    parser.add_argument(
        "--micro-in-flight",
        type=int,
        default=1,
        help="in-process requests at a time (32 to match wrk's connections)",
    )
    for section in ("load", "sampling", "micro", "collector", "ablation"):
        parser.add_argument(f"--skip-{section}", action="store_true", help=f"no {section} section")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 3 s runs")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="first wait up to this many seconds for a 1-minute load average under 1.5",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the files go")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.micro_requests, args.micro_trials = 1, 3, 300, 2
    return args


def _modes(names: str) -> tuple[Mode, ...]:
    wanted = {name.strip() for name in names.split(",")}
    if not wanted <= set(MODES):
        raise SystemExit(f"--modes: known modes are {', '.join(MODES)}")
    return tuple(mode for mode in MODES if mode in wanted)


def _header(argv: list[str], started: datetime) -> list[str]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    changed = len(git("status", "--porcelain", "--", "src").splitlines())
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in _VERSIONS)
    return [
        f"# python -m bench, {started:%Y-%m-%d %H:%M} UTC",
        "",
        f"Reproduce with: `{' '.join(['python -m bench', shlex.join(argv)]).strip()}`",
        f"Source: commit {git('rev-parse', '--short', 'HEAD')}, {changed} changed file(s) "
        f"under src/. Python {platform.python_version()}, {versions}; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.2f} at the start.",
    ]


def run_load(
    configs: tuple[Config, ...],
    services: Services,
    settings: LoadSettings,
    rounds: int,
    modes: tuple[Mode, ...],
    logs: Path,
) -> list[RunResult]:
    """Every configuration once per round, rounds interleaved (A B C … A B C …)."""
    results: list[RunResult] = []
    tag = uuid.uuid4().hex[:6]
    for round_number in range(1, rounds + 1):
        for config in configs:
            services.reset()
            run_id = f"{tag}r{round_number}{config.name}"
            app = AppSettings(
                config.name, services.redis_url, services.postgres_dsn, f"bench-{run_id}"
            )
            with UvicornServer(app, logs / f"{config.name}.log") as server:
                runs = measure(server, services, round_number, run_id, settings, modes)
            results += runs
            print(
                f"round {round_number}/{rounds} {config.name:16} "
                + ", ".join(
                    f"{r.mode} {r.wrk.rps:,.0f} req/s p99 {r.wrk.p99_ms:.1f} ms "
                    f"(foreign CPU {r.foreign_cpu_pct:.0f}%)"
                    for r in runs
                ),
                flush=True,
            )
    return results


def _span(values: list[float], form: Callable[[float], str]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    return form(low) if form(low) == form(high) else f"{form(low)}–{form(high)}"


def _ratios(
    runs: dict[tuple[str, Mode, int], RunResult], a: str, b: str | None, mode: Mode
) -> list[float]:
    """``a``'s req/s over ``b``'s, one ratio per round both ran in."""
    rounds = sorted({r for (c, m, r) in runs if c == a and m == mode})
    return [
        runs[a, mode, r].wrk.rps / runs[b, mode, r].wrk.rps
        for r in rounds
        if b is not None and (b, mode, r) in runs and runs[b, mode, r].wrk.rps
    ]


def load_tables(results: list[RunResult], modes: tuple[Mode, ...]) -> list[str]:
    """Per mode, each configuration against bare and its floor; then ours ÷ each peer."""
    runs = {(r.config, r.mode, r.round): r for r in results}
    configs = list(dict.fromkeys(r.config for r in results))
    ratio = lambda x: f"{x:.2f}"  # noqa: E731
    lines = [
        "req/s and p99 are medians over the rounds; ratios are per round, shown min–max. `dup`:"
        " executions beyond one per key (must be 0); `err`: wrk's socket errors and answers"
        " over 399 (a run with errors measured something else).",
        "",
    ]
    for mode in modes:
        lines += [
            f"### {mode} keys" if mode == "unique" else "### replays",
            "",
            "| config | req/s | p99 ms | × bare | × floor | p99 × bare | CPU µs/req "
            "| of it GC | of it kernel | store CPU µs/req | GC gen 0 / 1 / 2 per 1k | dup | err |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in configs:
            mine = [r for r in results if r.config == name and r.mode == mode]
            p99 = [
                run.wrk.p99_ms / runs["bare", mode, run.round].wrk.p99_ms
                for run in mine
                if ("bare", mode, run.round) in runs
            ]
            rps = statistics.median(r.wrk.rps for r in mine)
            p99_ms = statistics.median(r.wrk.p99_ms for r in mine)
            cpu_us = statistics.median(r.server_cpu_us for r in mine)
            gc_us = statistics.median(r.collector_us for r in mine)
            kernel_us = statistics.median(r.server_system_us for r in mine)
            store_us = statistics.median(r.store_cpu_us for r in mine)
            per_1k = " / ".join(
                f"{statistics.median(r.collections_per_1k[g] for r in mine):.1f}" for g in range(3)
            )
            # bare runs every request, replays included: no layer, nothing to count
            duplicates = "" if name == "bare" else sum(r.duplicates for r in mine)
            lines.append(
                f"| {name} | {rps:,.0f} | {p99_ms:.1f} "
                f"| {_span(_ratios(runs, name, 'bare', mode), ratio)} "
                f"| {_span(_ratios(runs, name, floor_of(name), mode), ratio)} "
                f"| {_span(p99, ratio)} | {cpu_us:.0f} | {gc_us:.1f} | {kernel_us:.0f} "
                f"| {store_us:.0f} | {per_1k} | {duplicates} "
                f"| {sum(r.wrk.errors for r in mine)} |"
            )
        lines.append("")
    ours = [name for name in configs if BY_NAME[name].kind == "ours"]
    lines += [
        "### ours ÷ each peer on the same store (req/s, per round)",
        "",
        "| ours | mode | " + " | ".join(f"÷ {peer}" for peer in PEERS) + " |",
        "|---|---|" + "---|" * len(PEERS),
    ]
    for name in ours:
        store = BY_NAME[name].store
        for mode in modes:
            cells = [_span(_ratios(runs, name, f"{peer}-{store}", mode), ratio) for peer in PEERS]
            if any(cells):
                lines.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    configs, skipped = installed(select(args.configs))
    modes = _modes(args.modes)
    deadline = time.monotonic() + args.wait_quiet
    while os.getloadavg()[0] > 1.5 and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.2f}: waiting for a quieter machine", flush=True)
        time.sleep(30)
    if not args.skip_load or not args.skip_sampling:
        wrk_binary()  # fail early with the install hint
    if not args.skip_sampling:
        sampling.py_spy()
    # The apps run without authentication: the one-time warning about unscoped keys is
    # expected here (the servers log at WARNING and above too).
    logging.getLogger("starlette_idempotency").setLevel(logging.ERROR)
    started = datetime.now(UTC)
    lines = [*_header(argv, started), *(f"- {note}" for note in skipped), ""]
    raw: dict[str, object] = {}
    need = {service for config in configs for service in config.needs}
    settings = LoadSettings(args.duration, warmup=args.warmup)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = f"{started:%Y-%m-%dT%H%M}"
    logs = Path(tempfile.mkdtemp(prefix="bench-logs-"))
    with private_services(redis="redis" in need, postgres="postgres" in need) as services:
        if not args.skip_load:
            results = run_load(configs, services, settings, args.rounds, modes, logs)
            lines += ["## Load (wrk, one uvicorn worker)", "", *load_tables(results, modes), ""]
            raw["load"] = [dataclasses.asdict(r) for r in results]
        if not args.skip_sampling:
            wanted = args.sample_configs.split(",") if args.sample_configs else SAMPLED
            selected = {config.name for config in configs}
            profiled: list[sampling.SelfTime] = []
            for name in [n.strip() for n in wanted if n.strip() in selected]:
                services.reset()
                run_id = f"spy{uuid.uuid4().hex[:6]}{name}"
                app = AppSettings(name, services.redis_url, services.postgres_dsn, run_id)
                with UvicornServer(app, logs / f"spy-{name}.log") as server:
                    for mode in modes:
                        raw_path = args.out / f"{stamp}-spy-{name}-{mode}.txt"
                        found = sampling.sample(
                            server, run_id, mode, settings, rate=args.rate, raw_path=raw_path
                        )
                        print(f"sampled {name} {mode}: {found.total_us:.0f} µs/req", flush=True)
                        profiled.append(found)
            lines += ["## Self time under load", "", sampling.table(profiled, args.rate), ""]
            raw["sampling"] = [dataclasses.asdict(p) for p in profiled]
        if not args.skip_micro:
            names = micro.micro_configs(configs, services.redis_url is not None)
            found_micro = micro.run_async(
                lambda: micro.microbench(
                    names,
                    args.micro_requests,
                    args.micro_trials,
                    services.redis_url,
                    args.micro_in_flight,
                )
            )
            lines += ["## In-process", "", micro.table(found_micro, args.micro_in_flight), ""]
            raw["micro"] = [dataclasses.asdict(m) for m in found_micro]
        if not args.skip_collector:
            runnable = micro.micro_configs(configs, services.redis_url is not None)
            counted = tuple(name for name in collector.CONFIGS if name in runnable)
            found_objects = micro.run_async(
                lambda: collector.measure(
                    counted,
                    args.micro_requests,
                    args.micro_trials,
                    services.redis_url,
                    args.micro_in_flight,
                )
            )
            lines += ["## What the collector sees", "", collector.tables(found_objects), ""]
            raw["collector"] = [dataclasses.asdict(c) for c in found_objects]
    if not args.skip_ablation:
        with private_services(redis=True, postgres=False) as services:
            url = services.redis_url
            assert url is not None
            samples = micro.run_async(
                lambda: ablation.measure(url, args.micro_requests, args.micro_trials)
            )
        lines += ["## What each step costs (bench.ablation)", "", ablation.report(samples), ""]
    summary = "\n".join(lines)
    print(summary)
    (args.out / f"{stamp}.md").write_text(summary)
    (args.out / f"{stamp}.json").write_text(json.dumps(raw, indent=1, default=str))
    print(f"wrote {args.out / f'{stamp}.md'} and .json", flush=True)
    return 0
