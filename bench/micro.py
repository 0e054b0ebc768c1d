"""In-process microbenchmark: the ASGI app awaited directly, ``in_flight`` requests at a time.

No network: each request builds its scope by hand (:mod:`bench.asgi`) and awaits the app on
uvloop, so the numbers are the CPU a request costs with nothing else in the way. Both the wall
time and the process's CPU time (``time.process_time``: every thread, so valkey-glide's Rust
threads count) are kept; with a Redis store the wall time also holds the waits for Redis. The
garbage collector's share is timed, and its collections counted, with a ``gc.callbacks``
stopwatch. One request at a time shows a layer's own work; as many in flight as wrk keeps (32)
shows what the collector adds under load, where the objects of many requests alive at once
make its youngest generation's collections far more frequent. Set these numbers beside
:mod:`bench.sampling`'s before trusting either.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import statistics
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.app import AppSettings, build_app
from bench.asgi import call, running
from bench.configs import Config
from bench.load import MODES, Mode

_T = TypeVar("_T")


def run_async(main: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run ``main`` on uvloop, as uvicorn does."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def micro_configs(configs: tuple[Config, ...], redis: bool) -> tuple[str, ...]:
    """The configurations that run in-process: those that need no server, and the Redis ones
    when a Redis server is up."""
    return tuple(
        config.name for config in configs if all(need == "redis" and redis for need in config.needs)
    )


@dataclass
class MicroResult:
    """Microseconds per request, one value per trial."""

    config: str
    mode: Mode
    wall_us: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    gc_us: list[float] = field(default_factory=list)
    collections: list[int] = field(default_factory=list)


@contextlib.contextmanager
def gc_stopwatch() -> Iterator[list[float]]:
    """Seconds spent in the cyclic garbage collector inside the block, and how many collections
    ran (``[seconds, collections]``)."""
    spent = [0.0, 0.0]
    started = [0.0]

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            spent[1] += 1

    gc.callbacks.append(watch)
    try:
        yield spent
    finally:
        gc.callbacks.remove(watch)


async def timed(app: Any, keys: list[str], in_flight: int = 1) -> tuple[float, float]:
    """Wall and CPU µs per request over ``keys``, ``in_flight`` requests at a time."""
    waiting = iter(keys)

    async def one_after_another() -> None:
        for key in waiting:
            reply = await call(app, key=key)
            if reply.status != 201:
                raise RuntimeError(f"micro request answered {reply.status}: {reply.body[:200]!r}")

    started, cpu_started = time.perf_counter_ns(), time.process_time_ns()
    await asyncio.gather(*(one_after_another() for _ in range(in_flight)))
    cpu = (time.process_time_ns() - cpu_started) / 1000 / len(keys)
    return (time.perf_counter_ns() - started) / 1000 / len(keys), cpu


def keys_for(mode: Mode, label: str, requests: int) -> list[str]:
    """New keys, or one key completed beforehand (``replayed``) sent ``requests`` times."""
    if mode == "unique":
        return [f"{label}-{i}" for i in range(requests)]
    return ["replayed"] * requests


async def microbench(
    configs: tuple[str, ...], requests: int, trials: int, redis_url: str | None, in_flight: int
) -> list[MicroResult]:
    """Trials interleaved across configurations and modes; the apps stay up between them."""
    results = {(c, m): MicroResult(c, m) for c in configs for m in MODES}
    tag = uuid.uuid4().hex[:6]
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for config in configs:
            settings = AppSettings(config, redis_url, prefix=f"micro-{tag}-{config}")
            app = await stack.enter_async_context(running(build_app(settings)))
            await call(app, key="replayed")
            await timed(app, keys_for("unique", f"warm-{config}", 200))
            apps[config] = app
        for trial in range(trials):
            for (config, mode), result in results.items():
                keys = keys_for(mode, f"{config}-{trial}", requests)
                # Each trial's collections walk only what it allocates, not what the other
                # configurations' apps and stores keep alive in this process.
                gc.collect()
                gc.freeze()
                with gc_stopwatch() as spent:
                    wall, cpu = await timed(apps[config], keys, in_flight)
                gc.unfreeze()
                result.wall_us.append(wall)
                result.cpu_us.append(cpu)
                result.gc_us.append(spent[0] * 1e6 / requests)
                result.collections.append(int(spent[1]))
    return list(results.values())


def table(results: list[MicroResult], in_flight: int) -> str:
    lines = [
        f"In-process µs per request, medians of the trials (no network, {in_flight} in flight):",
        "",
        "| config | mode | wall | CPU | of it in the collector | collections |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        wall, cpu, gc_us = map(statistics.median, (result.wall_us, result.cpu_us, result.gc_us))
        runs = statistics.median(result.collections)
        lines.append(
            f"| {result.config} | {result.mode} | {wall:.1f} | {cpu:.1f} | {gc_us:.1f} | {runs:g} |"
        )
    return "\n".join(lines)
