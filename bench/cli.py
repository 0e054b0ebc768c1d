"""``python -m bench``: run every part of the benchmark and write the markdown report."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from bench import ablation, fingerprint
from bench.app import AppSettings
from bench.configs import (
    APPS,
    BY_NAME,
    CONFIGS,
    AppName,
    Config,
    for_app,
    select,
    select_apps,
)
from bench.load import (
    MODES,
    LoadSettings,
    Mode,
    RunResult,
    measure,
    wrk_binary,
    wrk_version,
)
from bench.micro import (
    PROFILED,
    MicroResult,
    micro_configs,
    microbench,
    profile_hot_path,
    redis_pool_cost,
    run_async,
)
from bench.report import render
from bench.report_model import Meta, Report
from bench.roundtrips import count_all
from bench.servers import ROOT, Services, UvicornServer, private_services

RESULTS = Path(__file__).resolve().parent / "results"
PG_TABLE = "bench_idempotency"
_PACKAGES = (
    "uvicorn",
    "uvloop",
    "httptools",
    "starlette",
    "fastapi",
    "pydantic",
    "redis",
    "valkey-glide",
    "asyncpg",
    "orjson",
    "starlette-idempotency",
    "asgi-idempotency-header",
    "mobius-idempotence-library",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Measure the cost of being idempotent: uvicorn + wrk load against bare, "
        "a hand-written floor, this library's stores and peer libraries; store round trips; "
        "an in-process microbenchmark and a hot-path profile. Writes bench/results/<date>.md.",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--duration", type=float, default=10, help="seconds per wrk run")
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up per server")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset: " + ", ".join(c.name for c in CONFIGS),
    )
    parser.add_argument(
        "--app",
        default="both",
        choices=[*APPS, "both"],
        help="which service: plain (today's: snake_case body, ~300-byte answer), payments "
        "(issue #17's user app: camelCase four-field model, float amount; with the "
        "protect_all=True variants and the 500k-record MemoryStore), or both (default)",
    )
    parser.add_argument(
        "--modes",
        default="unique,replay",
        help="load modes to run: unique, replay or both (default unique,replay)",
    )
    parser.add_argument("--micro-requests", type=int, default=3000, help="requests per micro trial")
    parser.add_argument("--micro-trials", type=int, default=7, help="microbenchmark trials")
    parser.add_argument(
        "--profile-duration", type=float, default=5, help="seconds of wrk load per profile"
    )
    parser.add_argument("--skip-load", action="store_true", help="no uvicorn/wrk runs")
    parser.add_argument("--skip-counts", action="store_true", help="no round-trip counting")
    parser.add_argument("--skip-micro", action="store_true", help="no in-process microbenchmark")
    parser.add_argument("--skip-profile", action="store_true", help="no cProfile run")
    parser.add_argument(
        "--skip-fingerprint", action="store_true", help="no exclude_fields measurement"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 round, 3 s per run, short micro/profile",
    )
    parser.add_argument(
        "--max-load",
        type=float,
        default=1.5,
        help="with --wait-quiet, wait while the 1-minute load average is above this",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        help="seconds to wait at most (polling every 30 s) for a load average under --max-load",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 3, 1
        args.micro_requests, args.micro_trials, args.profile_duration = 500, 2, 2
    return args


def _versions(services: Services) -> dict[str, str]:
    versions = {"Python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["Redis server (private)"] = services.redis_version
    versions["PostgreSQL server (private)"] = (
        f"{services.postgres_version} ({services.postgres_settings})"
        if services.postgres_settings
        else services.postgres_version
    )
    versions["wrk"] = wrk_version()
    versions["starlette-idempotency source"] = _source_fingerprint()
    return versions


def _source_fingerprint() -> str:
    """Which library code was measured: the commit, uncommitted files, a hash of the tree."""
    import hashlib
    import subprocess

    source = ROOT / "src" / "starlette_idempotency"
    digest = hashlib.sha256()
    for path in sorted(source.rglob("*")):
        if path.suffix in (".py", ".lua", ".sql") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--", "src").splitlines()
    return (
        f"commit {git('rev-parse', '--short', 'HEAD') or '?'}, {len(changed)} uncommitted "
        f"path(s) under src/, tree sha256 {digest.hexdigest()[:12]}"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def wait_for_quiet(max_load: float, max_wait: float) -> str:
    """Poll every 30 s (up to ``max_wait``) for a 1-minute load average under ``max_load``."""
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        print(f"load average {_load()} > {max_load}: waiting 30 s for a quieter moment", flush=True)
        time.sleep(30)
    return _load()


def _peer_problems(configs: tuple[Config, ...]) -> tuple[tuple[Config, ...], list[str]]:
    """Drop peer configurations whose library cannot be imported, saying why."""
    kept, skipped = [], []
    modules = {"aih": "idempotency_header_middleware", "mobius": "mobius_idempotence"}
    for config in configs:
        prefix = config.name.split("-", 1)[0]
        module = modules.get(prefix)
        if module is not None:
            try:
                __import__(module)
            except ImportError as exc:
                skipped.append(f"`{config.name}` skipped: {exc} (pip install --group bench -e .)")
                continue
        kept.append(config)
    return tuple(kept), skipped


def run_load(
    plan: list[tuple[AppName, Config]],
    services: Services,
    settings: LoadSettings,
    rounds: int,
    logs: Path,
    prefills: list[dict[str, object]] | None = None,
    modes: tuple[Mode, ...] = MODES,
) -> list[RunResult]:
    """Every (app, configuration) of ``plan`` once per round, rounds interleaved."""
    results: list[RunResult] = []
    run_tag = uuid.uuid4().hex[:6]
    for round_number in range(1, rounds + 1):
        for app, config in plan:
            services.flush_redis()
            services.truncate_postgres(PG_TABLE)
            run_id = f"{run_tag}r{round_number}{app[:2]}{config.name}"
            app_settings = AppSettings(
                config=config.name,
                app=app,
                redis_url=services.redis_url,
                postgres_dsn=services.postgres_dsn,
                prefix=f"bench-{run_id}",
                pg_table=PG_TABLE,
            )
            started = time.monotonic()
            with UvicornServer(app_settings, logs / f"{app}-{config.name}.log") as server:
                if config.prefill:
                    filled = server.prefill(config.prefill)
                    print(
                        f"round {round_number}/{rounds} {app}/{config.name}: "
                        f"{filled['records']:,} records in {filled['seconds']:.1f} s",
                        flush=True,
                    )
                    if prefills is not None:
                        prefills.append({"app": app, "config": config.name, **filled})
                runs = measure(
                    server,
                    services,
                    config.name,
                    round_number,
                    run_id,
                    settings,
                    prefilled=config.prefill,
                    modes=modes,
                )
            results += runs
            summary = ", ".join(
                f"{r.mode} {r.wrk.rps:,.0f} req/s {r.server_cpu_us:.0f} µs cpu/req "
                f"p99 {r.wrk.p99_ms:.1f} ms (foreign {r.foreign_cpu_pct:.0f}%)"
                for r in runs
            )
            print(
                f"round {round_number}/{rounds} {app:8} {config.name:20} {summary} "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return results


def _modes(names: str) -> tuple[Mode, ...]:
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    unknown = wanted - set(MODES)
    if unknown or not wanted:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    return tuple(mode for mode in MODES if mode in wanted)


def _micro(
    app: AppName, names: tuple[str, ...], requests: int, trials: int, redis_url: str | None
) -> dict[tuple[str, Mode], MicroResult]:
    return run_async(lambda: microbench(names, requests, trials, app_name=app, redis_url=redis_url))


def _raw_json(report: Report) -> str:
    """Every measured number of the run, for later comparison (profile listings left out)."""
    import dataclasses
    import json

    data = {
        "meta": dataclasses.asdict(report.meta),
        "runs": [dataclasses.asdict(run) for run in report.runs],
        "counts": [  # by hand: asdict() would rebuild the Counters from (key, value) pairs
            {
                "config": result.config,
                "error": result.error,
                "record_bytes": result.record_bytes,
                "value_bytes": result.value_bytes,
                "cases": {
                    name: {
                        "status": count.status,
                        "round_trips": count.round_trips,
                        "client_commands": dict(count.client_commands),
                        "commands": dict(count.commands),
                        "pool_resets": count.extra,
                    }
                    for name, count in result.cases.items()
                },
            }
            for result in report.counts
        ],
        "micro": [
            dataclasses.asdict(result)
            for results in report.micro.values()
            for result in results.values()
        ],
        "prefills": report.prefills,
        "profiles": [
            {k: v for k, v in dataclasses.asdict(p).items() if k != "text"} for p in report.profiles
        ],
        "redis_pool_cpu_us": report.pool_cost,
        "skipped": report.skipped,
    }
    return json.dumps(data, indent=1, ensure_ascii=False, default=str)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = select(args.configs)
    configs, skipped = _peer_problems(configs)
    apps = select_apps(args.app)
    plan = [(app, config) for app in apps for config in for_app(configs, app)]
    if not plan:
        raise SystemExit(f"no configuration of {args.configs!r} runs in the {args.app} app(s)")
    # Round trips and the profile run once, on the user's app when it is measured.
    main_app: AppName = "payments" if "payments" in apps else apps[0]
    configs = tuple(dict.fromkeys(config for _, config in plan))
    if not args.skip_load:
        wrk_binary()  # fail early with the install hint
    load_before = wait_for_quiet(args.max_load, args.wait_quiet) if args.wait_quiet else _load()
    started = time.monotonic()
    now = datetime.now(UTC)
    command = "cd " + shlex.quote(str(ROOT)) + " && .venv/bin/python -m bench"
    if argv is None:
        argv = sys.argv[1:]
    if argv:
        command += " " + shlex.join(argv)
    need_redis = any("redis" in c.needs for c in configs) or not args.skip_profile
    need_postgres = any("postgres" in c.needs for c in configs)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-uvicorn-logs-"))
    # In-process stages build the app without authentication: its one-time warning about
    # unscoped keys is expected here (the level stays above INFO, as in the servers).
    logging.getLogger("starlette_idempotency").setLevel(logging.ERROR)
    report: Report
    with private_services(redis=need_redis, postgres=need_postgres) as services:
        settings = LoadSettings(
            duration=args.duration,
            connections=args.connections,
            threads=args.threads,
            warmup=args.warmup,
        )
        meta = Meta(
            date=now.strftime("%Y-%m-%d %H:%M UTC"),
            command=command,
            settings=(
                f"app(s) {', '.join(apps)}; modes {args.modes}; "
                f"{args.rounds} round(s), {args.duration:g} s per run after {args.warmup:g} s "
                f"warm-up, wrk -t{args.threads} -c{args.connections}; micro "
                f"{args.micro_trials} × {args.micro_requests} requests; profiles "
                f"{args.profile_duration:g} s of wrk load each"
            ),
            versions=_versions(services),
            machine={
                "CPU": _cpu_model(),
                "nproc": str(os.cpu_count()),
                "load average at start (1, 5, 15 min)": load_before,
                "kernel": platform.release(),
            },
            notes=[
                "Everything runs on one machine: wrk, uvicorn (one worker), and private "
                "redis-server / PostgreSQL processes started for this run (PostgreSQL with "
                "fsync and synchronous_commit off). Ratios matter more than absolute numbers.",
                "`wait_replicas` is not measured: with no replica, `WAIT 1` only measures "
                "its own timeout.",
            ],
        )
        report = Report(meta=meta, skipped=skipped, apps=list(apps), counts_app=main_app)
        if not args.skip_load:
            report.runs = run_load(
                plan,
                services,
                settings,
                args.rounds,
                logs,
                prefills=report.prefills,
                modes=_modes(args.modes),
            )
        if not args.skip_counts:
            print(f"counting store round trips ({main_app} app)", flush=True)
            report.counts = asyncio.run(
                count_all(
                    [c.name for c in for_app(configs, main_app)],
                    services.redis_url,
                    services.redis_port,
                    services.postgres_dsn,
                    main_app,
                )
            )
        if not args.skip_micro:
            for app in apps:
                print(f"in-process microbenchmark ({app} app)", flush=True)
                names = micro_configs(for_app(configs, app), services.redis_url is not None)
                report.micro[app] = _micro(
                    app, names, args.micro_requests, args.micro_trials, services.redis_url
                )
            if "payments" in apps and services.redis_url:
                print("what each step costs (bench.ablation, payments app)", flush=True)
                url = services.redis_url
                report.ablation = ablation.report(
                    run_async(lambda: ablation.measure(url, args.micro_requests, args.micro_trials))
                )
        if not args.skip_profile:
            print(f"profiling the hot path ({main_app} app)", flush=True)
            profile_settings = LoadSettings(
                duration=args.profile_duration,
                connections=args.connections,
                threads=args.threads,
                warmup=1,
            )
            profiled, _ = _peer_problems(tuple(BY_NAME[name] for name in PROFILED))
            report.profiles = profile_hot_path(
                services.redis_url,
                profile_settings,
                main_app,
                tuple(config.name for config in profiled),
            )
            if services.redis_url:
                redis_url = services.redis_url
                report.pool_cost = run_async(lambda: redis_pool_cost(redis_url))
    if not args.skip_fingerprint:
        print("fingerprint with and without exclude_fields", flush=True)
        body = fingerprint.orders_body()
        trials = 5 if args.quick else 31
        report.fingerprint = fingerprint.report(fingerprint.measure(body, trials), len(body))
    meta.machine["load average at end"] = _load()
    meta.machine["wall time of the run"] = f"{time.monotonic() - started:.0f} s"
    text = render(report)
    stamp = now.strftime("%Y-%m-%d")
    suffix = "-quick" if args.quick else ""
    dated = args.out / f"{stamp}{suffix}.md"
    dated.write_text(text)
    (args.out / f"latest{suffix}.md").write_text(text)
    (args.out / f"{stamp}{suffix}.json").write_text(_raw_json(report))
    for profile in report.profiles:
        name = f"profile-{stamp}{suffix}-{profile.config}-{profile.mode}.txt"
        (args.out / name).write_text(profile.text)
    shutil.rmtree(logs, ignore_errors=True)
    print(f"wrote {dated} and {args.out / f'latest{suffix}.md'}", flush=True)
    return 0
