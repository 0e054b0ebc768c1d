"""In-process microbenchmark and hot-path profile: the ASGI app called directly, no network.

Each request builds its scope by hand and awaits the app; requests run one after another on
uvloop, so the numbers are CPU time per request with nothing else in the way. Both the wall
time and the process's CPU time (``time.process_time``: every thread, so valkey-glide's Rust
threads count) are kept: with a Redis store the wall time also holds the waits for Redis, the
CPU time does not. The profile runs
the same loop under cProfile and attributes time to ``starlette_idempotency``: its functions'
own time plus everything they call outside the package, except the wrapped app itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench.app import AppSettings, build_app
from bench.asgi import call, running
from bench.configs import AppName, Config
from bench.load import MODES, LoadSettings, Mode
from bench.requests import REQUEST_BODIES


def micro_configs(configs: tuple[Config, ...], redis: bool) -> tuple[str, ...]:
    """The configurations the microbenchmark can call in-process: those that need no server,
    and the Redis ones when a Redis server is up (no PostgreSQL, no prefilled store)."""
    return tuple(
        config.name
        for config in configs
        if not config.prefill and all(need == "redis" and redis for need in config.needs)
    )


PACKAGE_MARK = "/starlette_idempotency/"
_T = TypeVar("_T")


def run_async(main: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run ``main`` on uvloop (as uvicorn does) when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


@dataclass
class MicroResult:
    """Microseconds per request, one value per trial, and the garbage collector's share."""

    config: str
    mode: Mode
    us_per_request: list[float] = field(default_factory=list)
    cpu_us_per_request: list[float] = field(default_factory=list)  # process CPU, all threads
    app: AppName = "plain"
    gc_us_per_request: list[float] = field(default_factory=list)
    gc_collections_per_1k: list[float] = field(default_factory=list)
    garbage_per_request: float = 0.0  # objects only the cycle collector frees
    garbage_types: list[tuple[str, float]] = field(default_factory=list)
    # Python-level calls per request by area (deterministic, unlike times), and the share of
    # the profiled time each area took (cProfile inflates small calls: read as shares)
    calls_by_area: dict[str, float] = field(default_factory=dict)
    profiled_share_by_area: dict[str, float] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.us_per_request)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_us_per_request) if self.cpu_us_per_request else 0.0


class GcClock:
    """Time spent in the cyclic garbage collector (``gc.callbacks``), and how often it ran."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections += 1

    @contextlib.contextmanager
    def installed(self) -> Any:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


async def _timed(app: Any, keys: list[str], body: bytes) -> tuple[float, float]:
    """Wall and CPU µs per request over ``keys``, one request after another."""
    started, cpu_started = time.perf_counter_ns(), time.process_time_ns()
    for key in keys:
        reply = await call(app, key=key, body=body)
        if reply.status != 201:
            raise RuntimeError(f"micro request answered {reply.status}: {reply.body[:200]!r}")
    cpu = (time.process_time_ns() - cpu_started) / 1000 / len(keys)
    return (time.perf_counter_ns() - started) / 1000 / len(keys), cpu


async def microbench(
    configs: tuple[str, ...],
    requests: int,
    trials: int,
    *,
    app_name: AppName = "plain",
    redis_url: str | None = None,
) -> dict[tuple[str, Mode], MicroResult]:
    """Trials interleaved across configurations and modes; the apps stay up between them."""
    results = {(c, m): MicroResult(c, m, app=app_name) for c in configs for m in MODES}
    body = REQUEST_BODIES[app_name]
    tag = uuid.uuid4().hex[:6]
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for config in configs:
            app, _ = build_app(
                AppSettings(
                    config=config,
                    app=app_name,
                    redis_url=redis_url,
                    prefix=f"micro-{tag}-{app_name}-{config}",
                )
            )
            apps[config] = await stack.enter_async_context(running(app))
            await call(app, key="micro-replayed", body=body)  # completes the replayed key
            await _timed(app, [f"micro-warm-{i}" for i in range(200)], body)
        for trial in range(trials):
            for config in configs:
                for mode in MODES:
                    if mode == "unique":
                        keys = [f"micro-{trial}-{i}" for i in range(requests)]
                    else:
                        keys = ["micro-replayed"] * requests
                    # Each trial's collections walk only what it allocates: not the records
                    # and apps the other configurations keep alive in this process (the walk
                    # over a store's own records is measured under load, in the tail section).
                    gc.collect()
                    gc.freeze()
                    with GcClock().installed() as clock:
                        us, cpu_us = await _timed(apps[config], keys, body)
                    gc.unfreeze()
                    result = results[config, mode]
                    result.us_per_request.append(us)
                    result.cpu_us_per_request.append(cpu_us)
                    result.gc_us_per_request.append(clock.seconds * 1e6 / requests)
                    result.gc_collections_per_1k.append(clock.collections * 1000 / requests)
        for config in configs:
            for mode in MODES:
                await _garbage_census(apps[config], results[config, mode], mode, body)
                await _call_census(apps[config], results[config, mode], mode, body)
    return results


# Where a function's file lies decides its area; the first fragment found wins.
AREAS: tuple[tuple[str, str], ...] = (
    ("/starlette_idempotency/", "starlette_idempotency"),
    ("/mobius_idempotence/", "mobius"),
    ("/idempotency_header_middleware/", "asgi-idempotency-header"),
    ("/bench/", "bench app, floor"),
    ("/fastapi/", "fastapi"),
    ("/starlette/", "starlette"),
    ("/pydantic", "pydantic"),
    ("/redis/", "redis-py"),
    ("/glide", "valkey-glide"),
    ("/asyncio/", "asyncio"),
    ("/json/", "json (stdlib)"),
)


def area_of(filename: str) -> str:
    if filename == "~":
        return "C functions"
    return next((area for mark, area in AREAS if mark in filename), "other Python")


async def _call_census(
    app: Any, result: MicroResult, mode: Mode, body: bytes, requests: int = 300
) -> None:
    """Python calls per request by area (cProfile's counts), and each area's profiled share."""
    keys = [f"calls-{i}" for i in range(requests)] if mode == "unique" else None
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        await _timed(app, keys or ["micro-replayed"] * requests, body)
    finally:
        profiler.disable()
    raw: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    calls: dict[str, float] = {}
    own: dict[str, float] = {}
    for (filename, _, _), (_, total_calls, own_time, _, _) in raw.items():
        area = area_of(filename)
        calls[area] = calls.get(area, 0.0) + total_calls / requests
        own[area] = own.get(area, 0.0) + own_time
    spent = sum(own.values()) or 1.0
    result.calls_by_area = dict(sorted(calls.items(), key=lambda item: -item[1]))
    result.profiled_share_by_area = {area: own[area] / spent for area in result.calls_by_area}


async def _garbage_census(
    app: Any, result: MicroResult, mode: Mode, body: bytes, requests: int = 500
) -> None:
    """What reference cycles a request leaves behind: objects only ``gc.collect`` frees."""
    keys = [f"census-{i}" for i in range(requests)] if mode == "unique" else None
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await _timed(app, keys or ["micro-replayed"] * requests, body)
        gc.collect()
        kinds: dict[str, int] = {}
        for obj in gc.garbage:
            name = type(obj).__qualname__
            code = getattr(obj, "__code__", None) or getattr(
                getattr(obj, "__func__", None), "__code__", None
            )
            if code is not None:
                name += f" {code.co_name}"
            kinds[name] = kinds.get(name, 0) + 1
        result.garbage_per_request = len(gc.garbage) / requests
        ranked = sorted(kinds.items(), key=lambda item: item[1], reverse=True)
        result.garbage_types = [(name, n / requests) for name, n in ranked[:12]]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


# --- profile ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cost:
    """Time per request attributed to one function (µs, under the profiler)."""

    function: str
    own_us: float
    inclusive_us: float
    calls_per_request: float


@dataclass
class ProfileResult:
    config: str
    mode: Mode
    requests: int
    total_us: float  # wall time per request under the profiler
    package_us: float  # attributed to starlette_idempotency (own + non-package callees)
    package_own_us: float  # own time of the package's functions only
    top_package: list[Cost]  # package functions by own time
    top_callees: list[Cost]  # outside functions the package calls, by time spent in them
    text: str  # the pstats report, for the results folder
    app: AppName = "plain"
    us_by_area: dict[str, float] = field(default_factory=dict)  # own time, µs/req (profiled)
    calls_by_area: dict[str, float] = field(default_factory=dict)  # calls per request


def _label(key: tuple[str, int, str]) -> str:
    filename, line, name = key
    if PACKAGE_MARK in filename:
        module = filename.split(PACKAGE_MARK, 1)[1].removesuffix(".py").replace("/", ".")
        return f"{module}:{line}:{name}"
    if filename == "~":
        return name
    short = "/".join(Path(filename).parts[-2:])
    return f"{short}:{line}:{name}"


_FRAMEWORKS = ("/starlette/", "/fastapi/", "/uvicorn/")
_ASGI_NAMES = frozenset({"__call__", "app", "send", "_send", "receive", "wrapped_app", "sender"})


def _is_app_call(key: tuple[str, int, str]) -> bool:
    """The wrapped app, or the server's own send/receive (which the bare app pays too)."""
    filename, _, name = key
    framework = any(mark in filename for mark in _FRAMEWORKS)
    return (framework and name in _ASGI_NAMES) or filename.endswith("bench/app.py")


def analyse(stats: pstats.Stats, requests: int) -> tuple[float, float, list[Cost], list[Cost]]:
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    own_total = 0.0
    package: list[Cost] = []
    callees: list[Cost] = []
    for key, (_, calls, own, inclusive, callers) in raw.items():
        per = 1e6 / requests
        if PACKAGE_MARK in key[0]:
            own_total += own
            package.append(Cost(_label(key), own * per, inclusive * per, calls / requests))
            continue
        if _is_app_call(key):
            continue
        from_package = [value for caller, value in callers.items() if PACKAGE_MARK in caller[0]]
        if from_package:
            spent = sum(value[3] for value in from_package)
            count = sum(value[1] for value in from_package)
            callees.append(Cost(_label(key), 0.0, spent * per, count / requests))
    package.sort(key=lambda cost: cost.own_us, reverse=True)
    callees.sort(key=lambda cost: cost.inclusive_us, reverse=True)
    own_us = own_total * 1e6 / requests
    attributed = own_us + sum(cost.inclusive_us for cost in callees)
    return attributed, own_us, package, callees


def profile_server(
    config: str,
    mode: Mode,
    redis_url: str | None,
    settings: LoadSettings,
    app_name: AppName = "plain",
) -> ProfileResult:
    """cProfile a uvicorn server run in this process while wrk loads it (the measured window
    only: the profiler is switched on and off from inside the server's event loop)."""
    import threading

    import uvicorn
    import uvloop

    from bench.load import run_wrk
    from bench.servers import http_request
    from starlette_idempotency.testing._processes import free_port, wait_until

    app, _ = build_app(
        AppSettings(
            config=config,
            app=app_name,
            redis_url=redis_url,
            prefix=f"profile-{app_name}-{config}-{mode}",
        )
    )
    body = REQUEST_BODIES[app_name]
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            loop="none",
            http="httptools",
            access_log=False,
            log_level="warning",
        )
    )
    loop = uvloop.new_event_loop()
    profiler = cProfile.Profile()
    outcome: dict[str, Any] = {}

    def on_loop(action: Callable[[], object]) -> None:
        done = threading.Event()

        def run() -> None:
            action()
            done.set()

        loop.call_soon_threadsafe(run)
        done.wait(10)

    def drive() -> None:
        try:
            wait_until(lambda: server.started, timeout=30, what="the profiled server")
            for _ in range(2):
                http_request(port, "POST", "/payments", key="profile-replayed", body=body)
            run_wrk(port, "unique", "profile-warm", duration=1, settings=settings, body=body)
            argument = "profile-replayed" if mode == "replay" else "profile-u"
            on_loop(profiler.enable)
            wrk, _ = run_wrk(
                port, mode, argument, duration=settings.duration, settings=settings, body=body
            )
            on_loop(profiler.disable)
            outcome["wrk"] = wrk
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            server.should_exit = True

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        loop.run_until_complete(server.serve())
    finally:
        loop.close()
    driver.join()
    if "error" in outcome:
        raise RuntimeError(f"profiling {config} {mode} failed") from outcome["error"]
    wrk = outcome["wrk"]
    requests = max(1, wrk.requests)
    stats = pstats.Stats(profiler)
    attributed, own, package, callees = analyse(stats, requests)
    us_by_area: dict[str, float] = {}
    calls_by_area: dict[str, float] = {}
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, total_calls, own_time, _, _) in raw.items():
        area = area_of(filename)
        us_by_area[area] = us_by_area.get(area, 0.0) + own_time * 1e6 / requests
        calls_by_area[area] = calls_by_area.get(area, 0.0) + total_calls / requests
    buffer = io.StringIO()
    report = pstats.Stats(profiler, stream=buffer)
    report.sort_stats("tottime").print_stats(40)
    report.sort_stats("cumulative").print_stats(PACKAGE_MARK.strip("/"), 40)
    return ProfileResult(
        config=config,
        mode=mode,
        requests=requests,
        total_us=wrk.duration_s * 1e6 / requests,
        package_us=attributed,
        package_own_us=own,
        top_package=package[:12],
        top_callees=callees[:12],
        text=buffer.getvalue(),
        app=app_name,
        us_by_area=dict(sorted(us_by_area.items(), key=lambda item: -item[1])),
        calls_by_area=calls_by_area,
    )


PROFILED = ("ours-memory", "ours-redis-setnx", "mobius-memory", "mobius-redis")


def profile_hot_path(
    redis_url: str | None,
    settings: LoadSettings,
    app_name: AppName = "plain",
    configs: tuple[str, ...] = PROFILED,
) -> list[ProfileResult]:
    """Ours on both stores (its costs, with suggestions), and mobius beside it (the same
    profile by area, for the comparison)."""
    configs = tuple(c for c in configs if redis_url or "redis" not in c)
    return [
        profile_server(config, mode, redis_url, settings, app_name)
        for config in configs
        for mode in MODES
    ]


POOLS = ("ConnectionPool", "BlockingConnectionPool", "mobius-redis's ConnectionPool")


async def _pool_cpu(redis_url: str, pool_name: str, commands: int, concurrency: int = 32) -> float:
    import redis.asyncio as aioredis

    client: Any
    if pool_name == "BlockingConnectionPool":
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=100)
        client = aioredis.Redis.from_pool(pool)
    elif pool_name == "mobius-redis's ConnectionPool":  # as its RedisBackend builds it
        mobius_pool = aioredis.ConnectionPool.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            max_connections=50,
            health_check_interval=30,
            retry_on_timeout=True,
        )
        client = aioredis.Redis(connection_pool=mobius_pool)
    else:
        client = aioredis.from_url(redis_url, max_connections=1000)
    try:
        await client.set("bench-pool-probe", b"x" * 300)

        async def worker() -> None:
            for _ in range(commands // concurrency):
                await client.set("bench-pool-probe", b"y", nx=True, px=30_000, get=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))  # warm-up
        started = time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return (time.process_time() - started) * 1e6 / commands
    finally:
        await client.aclose()


async def redis_pool_cost(
    redis_url: str, commands: int = 8000, trials: int = 3
) -> dict[str, float]:
    """CPU µs per ``SET NX PX GET`` through each of :data:`POOLS`, 32 concurrent callers."""
    samples: dict[str, list[float]] = {name: [] for name in POOLS}
    for _ in range(trials):
        for name in POOLS:
            samples[name].append(await _pool_cpu(redis_url, name, commands))
    return {name: statistics.median(values) for name, values in samples.items()}
