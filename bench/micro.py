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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench.app import AppSettings, CollectorTime, build_app
from bench.asgi import Reply, call, running
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
def gc_stopwatch() -> Iterator[CollectorTime]:
    """The collector's time and collections inside the block."""
    spent = CollectorTime()
    gc.callbacks.append(spent.watch)
    try:
        yield spent
    finally:
        gc.callbacks.remove(spent.watch)


Request = Coroutine[Any, Any, Reply]


def _as_is(request: Request) -> Awaitable[Reply]:
    return request


async def timed(
    app: Any,
    keys: list[str],
    in_flight: int = 1,
    through: Callable[[Request], Awaitable[Reply]] = _as_is,
) -> tuple[float, float]:
    """Wall and CPU µs per request over ``keys``, ``in_flight`` requests at a time, each awaited
    ``through`` a wrapper (by default none; :mod:`bench.collector` counts with one)."""
    waiting = iter(keys)

    async def one_after_another() -> None:
        for key in waiting:
            reply = await through(call(app, key=key))
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


@contextlib.asynccontextmanager
async def warm_apps(
    configs: tuple[str, ...], redis_url: str | None
) -> AsyncIterator[dict[str, Any]]:
    """Each configuration's app, running and warm: the ``replayed`` key completed and 200 new
    keys sent; each app stores under a prefix of its own."""
    tag = uuid.uuid4().hex[:6]
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for config in configs:
            settings = AppSettings(config, redis_url, prefix=f"micro-{tag}-{config}")
            app = await stack.enter_async_context(running(build_app(settings)))
            await call(app, key="replayed")
            await timed(app, keys_for("unique", f"warm-{config}", 200))
            apps[config] = app
        yield apps


async def microbench(
    configs: tuple[str, ...], requests: int, trials: int, redis_url: str | None, in_flight: int
) -> list[MicroResult]:
    """Trials interleaved across configurations and modes; the apps stay up between them."""
    results = {(c, m): MicroResult(c, m) for c in configs for m in MODES}
    async with warm_apps(configs, redis_url) as apps:
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
                result.gc_us.append(spent.seconds * 1e6 / requests)
                result.collections.append(spent.collections)
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
