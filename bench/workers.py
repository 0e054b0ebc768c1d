"""What the Redis driver is worth when every core runs a worker.

``python -m bench`` serves each configuration with one uvicorn worker, which leaves
valkey-glide's Rust threads a core of their own on a two-core machine. ``python -m bench.workers``
serves bare, the floor and ``RedisStore`` on both drivers with one worker per core (``uvicorn
--workers``), so the drivers compete for the same cores, and measures both modes with wrk
(interleaved rounds, medians). It prints a markdown table, ratios against the redis-py store of
the same round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import uuid
from pathlib import Path

from bench.app import AppSettings
from bench.load import MODES, LoadSettings, Mode, argument_for, run_wrk, warm_up
from bench.servers import UvicornServer, private_services

CONFIGS = ("bare", "floor-redis", "ours-redis", "ours-redis-glide")
Samples = dict[str, list[dict[Mode, float]]]  # per configuration, {mode: req/s} per round
BASELINE = "ours-redis"


def measure(workers: int, rounds: int, settings: LoadSettings) -> Samples:
    """Per configuration, one {mode: req/s} sample per round, rounds interleaved."""
    samples: Samples = {config: [] for config in CONFIGS}
    tag = uuid.uuid4().hex[:6]
    with (
        private_services(redis=True, postgres=False) as services,
        tempfile.TemporaryDirectory(prefix="bench-workers-") as logs,
    ):
        for round_number in range(1, rounds + 1):
            for config in CONFIGS:
                services.reset()
                run_id = f"{tag}r{round_number}{config}"
                app_settings = AppSettings(config, services.redis_url, prefix=f"bench-{run_id}")
                log = Path(logs) / f"{config}.log"
                rates: dict[Mode, float] = {}
                with UvicornServer(app_settings, log, workers=workers) as server:
                    warm_up(server, run_id, settings)
                    for mode in MODES:
                        wrk = run_wrk(
                            server.port, mode, argument_for(server, run_id, mode), settings
                        )
                        if wrk.errors:
                            raise RuntimeError(f"{config} {mode}: wrk saw errors: {wrk}")
                        rates[mode] = wrk.rps
                samples[config].append(rates)
                print(
                    f"round {round_number}/{rounds} {config:18} "
                    + ", ".join(f"{mode} {rate:,.0f} req/s" for mode, rate in rates.items()),
                    flush=True,
                )
    return samples


def report(samples: Samples, workers: int, rounds: int) -> str:
    lines = [
        f"uvicorn --workers {workers} on {os.cpu_count()} cores, wrk -t2 -c32, medians of "
        f"{rounds} interleaved rounds; × {BASELINE} is the median of per-round ratios.",
        "",
        "| config | unique req/s | × redis-py store | replay req/s | × redis-py store |",
        "|---|---|---|---|---|",
    ]
    for config, rounds_rates in samples.items():
        cells = [f"`{config}`"]
        for mode in MODES:
            rates = [rates[mode] for rates in rounds_rates]
            ratios = [
                rates[mode] / base[mode]
                for rates, base in zip(rounds_rates, samples[BASELINE], strict=True)
            ]
            cells += [f"{statistics.median(rates):,.0f}", f"{statistics.median(ratios):.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers", description=__doc__)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    args = parser.parse_args(argv)
    settings = LoadSettings(duration=args.duration, warmup=2.0)
    samples = measure(args.workers, args.rounds, settings)
    print(report(samples, args.workers, args.rounds))


if __name__ == "__main__":
    main()
