"""What each step of a guarded request costs: the microbenchmark with one step taken out.

``python -m bench.ablation`` awaits the app in-process (as :mod:`bench.micro` does) for
``ours-memory`` and ``ours-redis`` (against a private Redis server), unique keys
and replays, and measures the CPU per request with the whole middleware and with one step at a
time replaced by the cheapest stand-in that keeps the request answered alike:

- ``route``: the route looked up once per method and path (the cache by path that issue #8
  forbids: a ``Host`` or ``Mount`` can route one path to two endpoints);
- ``fingerprint``: the fingerprint computed once per body (no canonical form, no SHA-256);
- ``owner token``: a counter instead of ``os.urandom``;
- ``record decode``: each stored record parsed once (a replay finds it parsed);
- ``all``: all of them together.

The saving of a step is the full middleware's CPU minus the CPU without it. The floors
(``floor-memory``, ``floor-redis``: :mod:`bench.floor`) run in the same trials; what ``all``
leaves over its floor is the journey itself: the record and its encoding, the key and body
checks, wrapping ``receive`` and ``send``, storing the response, the coroutines in between.
Trials are interleaved; medians are reported. It prints a markdown table; nothing here is part
of the library, and the stand-ins are unsafe on purpose.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import statistics
import types
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from bench.app import AppSettings, build_app
from bench.asgi import call, running
from bench.configs import floor_of
from bench.load import MODES, Mode
from bench.micro import keys_for, run_async, timed
from bench.servers import private_services
from starlette_idempotency import _request, _routing
from starlette_idempotency._record import load_record
from starlette_idempotency.stores import memory
from starlette_idempotency.stores.redis import _store as redis_store

CONFIGS = ("ours-memory", "ours-redis")
# Each configuration's floor (bench.floor), measured in the same trials as the ``floor`` row.
FLOORS = {config: floor for config in CONFIGS if (floor := floor_of(config))}
Patch = Callable[[], contextlib.AbstractContextManager[Any]]


def _memo(function: Callable[..., Any], key: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` computed once per ``key(*args)``."""
    seen: dict[Any, Any] = {}

    def remembered(*args: Any) -> Any:
        found = key(*args)
        if found not in seen:
            seen[found] = function(*args)
        return seen[found]

    return remembered


def _route_by_path() -> contextlib.AbstractContextManager[Any]:
    resolve = _routing.RouteResolver.resolve
    by_path = _memo(resolve, lambda self, scope, app: (id(self), scope["method"], scope["path"]))
    return mock.patch.object(_routing.RouteResolver, "resolve", by_path)


def _fingerprint_once() -> contextlib.AbstractContextManager[Any]:
    fingerprint = _request.GuardedRequest._fingerprint
    once = _memo(fingerprint, lambda self, body, parsed: body)
    return mock.patch.object(_request.GuardedRequest, "_fingerprint", once)


def _counter_token() -> contextlib.AbstractContextManager[Any]:
    counter = itertools.count()

    def urandom(size: int) -> bytes:
        return next(counter).to_bytes(size, "big")

    return mock.patch.object(_request, "os", types.SimpleNamespace(urandom=urandom))


@contextlib.contextmanager
def _decode_once() -> Iterator[None]:
    with (
        mock.patch(f"{redis_store.__name__}.load_record", _memo(load_record, bytes)),
        mock.patch.object(memory, "_unpack", _memo(memory._unpack, bytes)),
    ):
        yield


STEPS: dict[str, Patch] = {
    "route": _route_by_path,
    "fingerprint": _fingerprint_once,
    "owner token": _counter_token,
    "record decode": _decode_once,
}


@contextlib.contextmanager
def _without(steps: tuple[str, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for step in steps:
            stack.enter_context(STEPS[step]())
        yield


async def measure(
    redis_url: str, requests: int, trials: int
) -> dict[tuple[str, str, Mode], list[float]]:
    """CPU µs per request by (variant, config, mode); variants are ``full``, each step, ``all``."""
    variants: dict[str, tuple[str, ...]] = {"full": (), **{s: (s,) for s in STEPS}}
    variants["all"] = tuple(STEPS)
    samples: dict[tuple[str, str, Mode], list[float]] = {}
    tag = uuid.uuid4().hex[:6]
    async with contextlib.AsyncExitStack() as stack:
        apps = {}
        for config in (*CONFIGS, *FLOORS.values()):
            settings = AppSettings(config, redis_url, prefix=f"ablation-{tag}-{config}")
            app = await stack.enter_async_context(running(build_app(settings)))
            await call(app, key="replayed")
            await timed(app, keys_for("unique", f"warm-{config}", 300))
            apps[config] = app
        for trial in range(trials):
            for variant, steps in variants.items():
                for config, app in apps.items():
                    if config in FLOORS.values() and variant != "full":
                        continue
                    for mode in MODES:
                        label = f"{variant.replace(' ', '_')}-{trial}"
                        gc.collect()
                        with _without(steps):
                            _, cpu = await timed(app, keys_for(mode, label, requests))
                        samples.setdefault((variant, config, mode), []).append(cpu)
    return samples


def report(samples: dict[tuple[str, str, Mode], list[float]]) -> str:
    columns = [(config, mode) for config in CONFIGS for mode in MODES]
    median = {key: statistics.median(values) for key, values in samples.items()}
    trials = len(next(iter(samples.values())))
    lines = [
        "In-process CPU µs per request, medians of "
        f"{trials} interleaved trials; a step's row is the CPU with that step replaced by its "
        "stand-in (`python -m bench.ablation`), with the saving against `full` in brackets.",
        "",
        "| without | " + " | ".join(f"`{c}` {m}" for c, m in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    variants = dict.fromkeys(variant for variant, _, _ in samples)
    for variant in variants:
        cells = []
        for config, mode in columns:
            value = median[variant, config, mode]
            saving = median["full", config, mode] - value
            cells.append(f"{value:.1f}" if variant == "full" else f"{value:.1f} ({saving:+.1f})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    floors = [median["full", FLOORS[config], mode] for config, mode in columns]
    lines.append("| the floor | " + " | ".join(f"{value:.1f}" for value in floors) + " |")
    over = [median["all", c, m] - floor for (c, m), floor in zip(columns, floors, strict=True)]
    lines.append("| `all` over the floor | " + " | ".join(f"{v:+.1f}" for v in over) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="requests per trial")
    parser.add_argument("--trials", type=int, default=7, help="interleaved trials")
    args = parser.parse_args(argv)
    with private_services(redis=True, postgres=False) as services:
        assert services.redis_url is not None
        url = services.redis_url
        samples = run_async(lambda: measure(url, args.requests, args.trials))
    print(report(samples))


if __name__ == "__main__":
    main()
