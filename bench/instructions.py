"""Instructions per request, counted by valgrind: the one figure here that does not drift.

``python -m bench.instructions`` awaits each configuration's app in-process (as
:mod:`bench.micro` does: warm, ``--in-flight`` requests at a time) under
``valgrind --tool=callgrind``, once for ``--base`` requests and once for ``--base`` plus
``--requests``; the difference over ``--requests`` is what one request executes, with the
interpreter's start, the imports, the app's startup and the warm-up taken out. The collector's
work counts where it falls, as it does under load. On a machine whose wall-clock figures move
by a sixth between runs, this tells a change's cost apart from the noise; set it beside the
load section, which is what users see. Each run takes a minute or two; runs go two at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.app import AppSettings, build_app
from bench.asgi import call, running
from bench.configs import installed, select
from bench.load import MODES, Mode
from bench.micro import keys_for, run_async, timed
from bench.servers import ROOT, private_services

_COLLECTED = re.compile(r"Collected : (\d+)")


async def _requests(config: str, mode: Mode, count: int, redis_url: str, in_flight: int) -> None:
    settings = AppSettings(config, redis_url, prefix=f"instructions-{uuid.uuid4().hex[:6]}")
    async with running(build_app(settings)) as app:
        await call(app, key="replayed")
        await timed(app, keys_for("unique", "warm", 200), in_flight)
        await timed(app, keys_for(mode, "counted", count), in_flight)


def _instructions(config: str, mode: Mode, count: int, redis_url: str, in_flight: int) -> int:
    """What valgrind counts for the whole process that sends ``count`` requests."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    child = [sys.executable, "-m", "bench.instructions", "--child", config, mode, str(count)]
    child += ["--redis-url", redis_url, "--in-flight", str(in_flight)]
    done = subprocess.run(
        [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", *child],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{config} {mode} under valgrind failed: {done.stderr[-2000:]}")
    return int(found[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--configs", default="ours-memory-all,ours-redis-all")
    parser.add_argument("--modes", default="unique,replay", help="unique, replay or both")
    parser.add_argument("--requests", type=int, default=1200, help="requests counted")
    parser.add_argument("--base", type=int, default=300, help="requests of the shorter run")
    parser.add_argument("--in-flight", type=int, default=32, help="requests at a time")
    parser.add_argument("--redis-url", help="an existing Redis server (default: a private one)")
    parser.add_argument("--child", nargs=3, metavar=("CONFIG", "MODE", "COUNT"), help="internal")
    args = parser.parse_args(argv)
    if args.child:
        config, mode, requests = args.child
        run_async(lambda: _requests(config, mode, int(requests), args.redis_url, args.in_flight))
        return
    selected, skipped = installed(select(args.configs))
    for note in skipped:
        print(note)
    modes = [mode for mode in MODES if mode in args.modes.split(",")]
    runs = [(config.name, mode) for config in selected for mode in modes]
    counted_requests: int = args.requests

    def report(url: str) -> None:
        def per_request(run: tuple[str, Mode]) -> float:
            short, long = (
                _instructions(*run, n, url, args.in_flight)
                for n in (args.base, args.base + counted_requests)
            )
            return (long - short) / counted_requests

        with ThreadPoolExecutor(max_workers=2) as pool:
            counted = list(pool.map(per_request, runs))
        print(f"Instructions per request (callgrind, {args.in_flight} in flight, in-process):")
        print("\n| config | mode | instructions |\n|---|---|---|")
        for (config, mode), instructions in zip(runs, counted, strict=True):
            print(f"| {config} | {mode} | {instructions / 1000:,.0f}K |")

    if args.redis_url:
        report(args.redis_url)
    else:
        with private_services(redis=True, postgres=False) as services:
            assert services.redis_url is not None
            report(services.redis_url)


if __name__ == "__main__":
    main()
