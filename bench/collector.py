"""What a request leaves the garbage collector, ``in_flight`` requests at a time (issue #33).

``python -m bench.collector`` (and the ``collector`` section of ``python -m bench``) awaits the
apps in-process, as :mod:`bench.micro` does, for ours and the peers on Redis and in memory, new
keys and replays, with the pools warmed at ``in_flight`` first, and counts per request:

- **What it allocates**, by kind: a run with a collection after every second allocation of a
  GC-capable object (``gc.set_threshold(1)``), whose ``gc.callbacks`` hook lists the youngest
  generation before each one. Each tracked object that lives until the next collection is seen
  exactly once; temporaries freed sooner, and containers the interpreter leaves untracked (a
  dict of strings and numbers), are not: the kinds are a floor, alike for every library.
- **What it leaves and holds**: a run with the collector off, the heap frozen before, and each
  request's coroutine stepped by hand, the collector's own counter (``gc.get_count()[0]``:
  GC-capable objects allocated less those freed, the number that sets off a collection past
  700) read around each step. ``left``: the counter's rise over the run; of it ``garbage``,
  what a ``DEBUG_SAVEALL`` collection then finds in reference cycles. ``held``: the sum of a
  request's steps up to its first and up to its last suspension, what it keeps while the
  other requests run. On Redis both are store calls (ours: the acquire, then the finish; a
  replay's one round trip is both); a round trip can suspend twice (redis-py sends through
  ``asyncio.wait_for`` when a socket timeout is set, then may wait for the reply), and a
  layer may wait for a task of its own, hence the ``suspensions`` column. In memory nothing
  suspends. Allocations outside the request's task (the event loop's callbacks, a task it
  starts, such as redis-py's send) count in ``left``, not in ``held``.
- **Collections per 1,000 requests**, by generation: runs with the collector on and the heap
  frozen first, as :mod:`bench.micro` runs them; medians of the trials. Every collection
  resets the counter, whose decrements stop at zero, so ``missed``, the collections' share of
  the counter less ``left``, estimates the frees it did not count: objects that were alive at
  a collection, freed before the count rose again. They set off the collections that the
  objects left do not explain. ``replayed``: the collections that the counter's readings at
  the start and the end of every step (taken in the run with the collector off), replayed in
  order under the collector's rules, set off: how much of the count the swings of all the
  requests' objects between their suspensions explain, leaving out what moves inside a step.

The harness's own objects (the scope, ``receive`` and ``send``: :mod:`bench.asgi`) count alike
for every configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import statistics
import types
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from bench.asgi import Reply
from bench.configs import installed, select
from bench.load import MODES, Mode
from bench.micro import Request, gc_stopwatch, keys_for, run_async, timed, warm_apps
from bench.servers import private_services

CONFIGS = (
    "ours-redis",
    "idemgate-redis",
    "idemkit-redis",
    "mobius-redis",
    "ours-memory",
    "idemkit-memory",
    "mobius-memory",
)


@functools.cache
def _kinds() -> tuple[tuple[str, tuple[type, ...]], ...]:
    import uvloop.loop

    uvloop_handles = tuple(getattr(uvloop.loop, name) for name in ("Handle", "TimerHandle"))
    return (
        ("dicts", (dict,)),
        ("tuples", (tuple,)),
        ("lists", (list,)),
        (
            "functions",
            (types.FunctionType, types.MethodType, types.CellType, types.BuiltinMethodType),
        ),
        ("coroutines", (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)),
        ("tasks", (asyncio.Task,)),
        ("futures", (asyncio.Future,)),
        ("loop handles", (asyncio.Handle, *uvloop_handles)),
        ("exceptions", (BaseException, types.TracebackType, types.FrameType)),
    )


KINDS = (*(name for name, _ in _kinds()), "other")


@dataclass
class CollectorResult:
    """Per request, at ``in_flight`` requests at a time."""

    config: str
    mode: Mode
    in_flight: int
    allocated: dict[str, float] = field(default_factory=dict)
    other: dict[str, float] = field(default_factory=dict)
    left: float = 0.0
    garbage: float = 0.0
    held: list[float] = field(default_factory=list)  # at the first and the last suspension
    suspensions: float = 0.0
    collections: list[float] = field(default_factory=list)
    threshold: int = 700
    replayed: float = 0.0

    @property
    def missed(self) -> float:
        """Frees the counter did not count, per request (see the module's docstring)."""
        return max(0.0, sum(self.collections) / 1000 * (self.threshold + 1) - self.left)


@dataclass
class _Tally:
    """Sums over a run's requests, made before the heap is frozen: counting into them makes no
    object the count would see."""

    first: int = 0
    last: int = 0
    suspended: int = 0
    suspensions: int = 0
    counts: list[int] = field(default_factory=list)  # the counter as each step starts and ends


@types.coroutine
def _counted(request: Request, tally: _Tally) -> Generator[Any, Any, Reply]:
    """Await ``request``, adding to ``tally`` what it holds at its first and last suspension."""
    held = first = suspensions = 0
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        before = gc.get_count()[0]
        tally.counts.append(before)
        try:
            signal = request.send(sent) if thrown is None else request.throw(thrown)
        except StopIteration as done:
            tally.counts.append(gc.get_count()[0])
            if suspensions:
                tally.first += first
                tally.last += held
                tally.suspended += 1
                tally.suspensions += suspensions
            reply: Reply = done.value
            return reply
        after = gc.get_count()[0]
        tally.counts.append(after)
        held += after - before
        first = held if not suspensions else first
        suspensions += 1
        try:
            sent, thrown = (yield signal), None
        except BaseException as exc:
            sent, thrown = None, exc


def _replayed(counts: list[int], threshold: int) -> int:
    """The collections ``counts`` sets off under the collector's rules: a collection once the
    counter passes ``threshold`` resets it, and it never drops below zero."""
    counter = collections = 0
    for before, after in itertools.pairwise(counts):
        counter = max(0, counter + after - before)
        if counter > threshold:
            counter, collections = 0, collections + 1
    return collections


def _kind(obj: object) -> str:
    return next((name for name, types_ in _kinds() if isinstance(obj, types_)), "other")


async def _allocated(app: Any, result: CollectorResult, keys: list[str]) -> None:
    """What the requests allocate, by kind: the youngest generation listed before a collection
    after every second allocation."""
    kinds, others = Counter[str](), Counter[str]()

    def listed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            for obj in gc.get_objects(generation=0):
                kind = _kind(obj)
                kinds[kind] += 1
                if kind == "other":
                    others[type(obj).__qualname__] += 1

    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.callbacks.append(listed)
    gc.set_threshold(1, 1 << 30, 1 << 30)
    try:
        await timed(app, keys, result.in_flight)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(listed)
        gc.unfreeze()
    result.allocated = {kind: kinds[kind] / len(keys) for kind in KINDS}
    result.other = {name: n / len(keys) for name, n in others.most_common(2)}


async def _left(app: Any, result: CollectorResult, keys: list[str]) -> None:
    """What the requests leave, and hold while suspended: a run with the collector off."""
    tally = _Tally()
    through = functools.partial(_counted, tally=tally)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        counted = gc.get_count()[0]
        await timed(app, keys, result.in_flight, through)
        left = gc.get_count()[0] - counted
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect(0)
        garbage = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.unfreeze()
    result.left, result.garbage = left / len(keys), garbage / len(keys)
    if tally.suspended:
        result.held = [tally.first / tally.suspended, tally.last / tally.suspended]
    result.suspensions = tally.suspensions / len(keys)
    result.replayed = _replayed(tally.counts, result.threshold) * 1000 / len(keys)


async def _collections(app: Any, keys: list[str], in_flight: int) -> list[int]:
    """Collections by generation over ``keys``, the heap frozen first."""
    gc.collect()
    gc.freeze()
    try:
        with gc_stopwatch() as spent:
            await timed(app, keys, in_flight)
    finally:
        gc.unfreeze()
    return spent.by_generation


async def measure(
    configs: tuple[str, ...], requests: int, trials: int, redis_url: str | None, in_flight: int
) -> list[CollectorResult]:
    """Each configuration and mode: the three kinds of run above, on fresh keys each."""
    results = []
    async with warm_apps(configs, redis_url) as apps:
        for config, app in apps.items():
            await timed(app, keys_for("unique", f"{config}-warm-{in_flight}", 200), in_flight)
            for mode in MODES:
                result = CollectorResult(config, mode, in_flight, threshold=gc.get_threshold()[0])
                await _allocated(app, result, keys_for(mode, f"{config}-seen", requests))
                await _left(app, result, keys_for(mode, f"{config}-left", requests))
                runs = [
                    await _collections(
                        app, keys_for(mode, f"{config}-{trial}", requests), in_flight
                    )
                    for trial in range(trials)
                ]
                result.collections = [
                    statistics.median(run[generation] for run in runs) * 1000 / requests
                    for generation in range(3)
                ]
                results.append(result)
    return results


def _path(result: CollectorResult) -> str:
    store = "Redis" if result.config.endswith("-redis") else "Memory"
    return f"{store}, {'new key' if result.mode == 'unique' else 'replay'}"


def tables(results: list[CollectorResult]) -> str:
    """One table per path (store and mode), a row per configuration."""
    if not results:
        return "No configuration of bench.collector was selected."
    lines = [
        f"Per request, {results[0].in_flight} in flight (bench.collector). Tracked objects"
        " allocated, by kind, as a collection after every second allocation sees them; `left`:"
        " the collector's count left after the request, of it `garbage` in cycles; `held`: its"
        " count of what the request holds at its first and its last suspension (on Redis: the"
        " first and the last store call); collections by generation per 1,000 requests;"
        " `replayed`: those the counter's readings at the requests' steps set off alone;"
        " `missed`: frees the count lost at zero after a collection.",
    ]
    columns = [
        *KINDS,
        "seen",
        "left",
        "garbage",
        "suspensions",
        "held first / last",
        "gen 0 / 1 / 2",
        "replayed",
        "missed",
        "of other",
    ]
    for path in dict.fromkeys(map(_path, results)):
        lines += [
            "",
            f"### {path}",
            "",
            "| config | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for result in (r for r in results if _path(r) == path):
            cells = [
                *(f"{result.allocated[kind]:.0f}" for kind in KINDS),
                f"{sum(result.allocated.values()):.0f}",
                f"{result.left:.1f}",
                f"{result.garbage:.1f}",
                f"{result.suspensions:.1f}",
                " / ".join(f"{held:.0f}" for held in result.held) or "none",
                " / ".join(f"{n:.0f}" for n in result.collections),
                f"{result.replayed:.0f}",
                f"{result.missed:.0f}",
                ", ".join(f"{name} {n:.0f}" for name, n in result.other.items()),
            ]
            lines.append(f"| {result.config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.collector", description=__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--requests", type=int, default=2000, help="requests per run")
    parser.add_argument("--trials", type=int, default=3, help="runs counting collections")
    parser.add_argument("--in-flight", type=int, default=32, help="requests at a time")
    parser.add_argument(
        "--redis-url", help="an existing Redis server (default: a private one is started)"
    )
    args = parser.parse_args(argv)
    selected, skipped = installed(select(args.configs))
    for note in skipped:
        print(note)
    configs = tuple(config.name for config in selected)

    def run(url: str | None) -> list[CollectorResult]:
        return run_async(lambda: measure(configs, args.requests, args.trials, url, args.in_flight))

    if args.redis_url:
        print(tables(run(args.redis_url)))
    else:
        with private_services(redis=True, postgres=False) as services:
            print(tables(run(services.redis_url)))


if __name__ == "__main__":
    main()
