"""The markdown report: tables, ratios to ``bare`` and to the floor, targets, profile findings."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.configs import BY_NAME, FLOOR_FOR, AppName, floor_of
from bench.load import MODES, Mode
from bench.micro import Cost, MicroResult, ProfileResult
from bench.report_model import Report, Runs, Spread, cpu_allowance, ratio_cell, table
from bench.report_payments import payments_sections
from bench.roundtrips import ConfigCounts

RATIO_UNIQUE_VS_FLOOR = 0.9
RATIO_REPLAY_VS_FLOOR = 0.9
RATIO_MEMORY_UNIQUE_VS_BARE = 0.85
RATIO_MEMORY_REPLAY_VS_BARE = 2.0
APP_DESCRIPTIONS: dict[AppName, str] = {
    "plain": "today's service (snake_case body with an `int` amount, ~300-byte answer); "
    "`ours-*` is `IdempotencyMiddleware` + `@idempotent()` on the route",
    "payments": "issue #17's user app: a four-field camelCase pydantic model (`accountId`, "
    "`amount: float`, `currency`, `merchantReference`) answered with a small dict; "
    "`ours-*` decorates the route with `@idempotent()`, `ours-*-all` leaves it bare and "
    "passes `protect_all=True` (every POST guarded)",
}
PEERS_LIKE_FOR_LIKE = {
    "redis": ("aih-redis", "mobius-redis"),
    "memory": ("aih-memory", "mobius-memory"),
}


# --- sections -----------------------------------------------------------------------------


def load_section(runs: Runs, mode: Mode, heading: str = "###") -> list[str]:
    title = {
        "unique": "Unique key per request (every request acquires, runs, completes)",
        "replay": "One key replayed (every request is answered from the store)",
    }[mode]
    lines = [f"{heading} {title}", ""]
    speed, cost = [], []
    for config in runs.configs:
        results = runs.of(config, mode)
        if not results:
            continue
        floor = floor_of(config)

        def cell(metric: str, digits: int = 0) -> str:
            spread = runs.values(config, mode, metric)  # noqa: B023 - used at once
            return spread.show(digits) if spread else "–"

        def ratio(other: str | None, metric: str) -> str:
            if other is None:
                return "–"
            return ratio_cell(runs.ratio(config, other, mode, metric))  # noqa: B023

        speed.append(
            [
                f"`{config}`",
                cell("rps"),
                ratio("bare", "rps"),
                ratio(floor, "rps"),
                cell("p50", 2),
                ratio("bare", "p50"),
                cell("p99", 2),
                ratio("bare", "p99"),
                ratio(floor, "p99"),
            ]
        )
        executions = sum(r.executions for r in results)
        duplicates = sum(r.duplicates for r in results)
        issued = sum(r.wrk.keys_issued for r in results)
        answered = sum(r.wrk.requests for r in results)
        if mode == "unique":
            check = f"{executions:,} / {issued:,}, {duplicates} dup"
        else:
            check = f"{executions:,} for {answered:,} requests"
        cost.append(
            [
                f"`{config}`",
                cell("cpu"),
                ratio("bare", "cpu-rate"),
                ratio(floor, "cpu-rate"),
                cell("store-cpu"),
                f"{sum(r.wrk.errors_socket for r in results)} / "
                f"{sum(r.wrk.errors_status for r in results)}",
                check,
                f"{max(r.rss_kib for r in results) / 1024:.0f}",
                cell("foreign"),
            ]
        )
    if not speed:
        return []
    lines += table(
        [
            "config",
            "req/s median (min–max)",
            "req/s × bare",
            "req/s × floor",
            "p50 ms",
            "p50 × bare",
            "p99 ms",
            "p99 × bare",
            "p99 × floor",
        ],
        speed,
    )
    lines.append("")
    lines += table(
        [
            "config",
            "server CPU µs/req",
            "CPU-implied × bare",
            "CPU-implied × floor",
            "store CPU µs/req",
            "socket err / non-2xx",
            "handler executions" if mode == "replay" else "executions / keys issued",
            "RSS MiB",
            "foreign CPU %",
        ],
        cost,
    )
    lines.append("")
    return lines


def counts_section(counts: Sequence[ConfigCounts], app: AppName = "plain") -> list[str]:
    lines = [
        f"## Store round trips per request (counted by the servers; `{app}` app)",
        "",
        "Redis: commands the app's connections sent, from `MONITOR` on the private server "
        "(commands a Lua script ran are not round trips); the last column is the "
        "`INFO commandstats` delta, scripts' inner commands included. PostgreSQL: statements "
        "from asyncpg's query logger; *pool resets* are asyncpg's own reset query when a "
        "connection returns to the pool (one extra round trip per `pool.fetchval`).",
        "",
    ]
    rows = []
    for result in counts:
        if result.error:
            rows.append([f"`{result.config}`", "error", "–", result.error, "–", "–"])
            continue
        for case, count in result.cases.items():
            rows.append(
                [
                    f"`{result.config}`",
                    case,
                    str(count.status),
                    f"**{count.round_trips}**: {count.describe()}",
                    str(count.extra) if result.config == "ours-postgres" else "–",
                    count.describe_all(),
                ]
            )
    lines += table(
        ["config", "case", "status", "round trips", "pool resets", "server-side commands"], rows
    )
    resets = sum(
        count.extra
        for result in counts
        if result.config == "ours-postgres"
        for name, count in result.cases.items()
        if name == "first request"
    )
    if resets:
        lines += [
            "",
            f"**Finding:** a first request through PostgresStore costs {resets} more server "
            "round trip(s) than it has statements: each `pool.fetchval` checks a connection "
            "out and back in, and asyncpg resets it on the way back "
            "(`SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;`). The "
            "store keeps no session state, so a pool it creates itself could pass "
            "`create_pool(reset=...)` a coroutine that does nothing (asyncpg ≥ 0.30), "
            "halving its round trips; a user's own pool can do the same.",
        ]
    lines += ["", "### Size of one stored record (a 308-byte JSON response)", ""]
    rows = []
    for result in counts:
        for key, size in result.record_bytes.items():
            value = result.value_bytes.get(key)
            kind = "row (pg_column_size)" if result.config == "ours-postgres" else "MEMORY USAGE"
            rows.append(
                [
                    f"`{result.config}`",
                    f"`{key}`",
                    f"{size:,} ({kind})",
                    "–" if value is None else f"{value:,}",
                ]
            )
    lines += table(["config", "key", "bytes", "stored value / body bytes"], rows)
    lines.append("")
    return lines


def micro_section(micro: dict[tuple[str, Mode], MicroResult], app: AppName = "plain") -> list[str]:
    if not micro:
        return []
    lines = [
        f"## In-process microbenchmark (no network, one request at a time; `{app}` app)",
        "",
        "The ASGI app awaited directly with a hand-built scope, on uvloop; median of the "
        "trials (min–max). *µs/req* is wall time (with a Redis store it includes the waits "
        "for Redis), *CPU µs/req* the process's CPU time (`time.process_time`, all threads: "
        "valkey-glide's Rust threads count). Overhead is the difference of CPU time to `bare` "
        "in the same mode; the throughput ratio is bare's CPU time over the configuration's. "
        "*GC* is the time the "
        "cyclic garbage collector ran during the trials (`gc.callbacks`), already inside the "
        "µs/req; *cyclic garbage* counts the objects per request that only the collector "
        "frees (reference cycles, `gc.DEBUG_SAVEALL`).",
        "",
    ]
    rows = []
    configs = list(dict.fromkeys(config for config, _ in micro))
    for config in configs:
        for mode in MODES:
            result = micro.get((config, mode))
            bare = micro.get(("bare", mode))
            if result is None or bare is None:
                continue
            spread = Spread.of(result.us_per_request)
            cpu_spread = Spread.of(result.cpu_us_per_request)
            gc_spread = Spread.of(result.gc_us_per_request)
            assert spread is not None
            cpu, bare_cpu = result.cpu_median, bare.cpu_median
            rows.append(
                [
                    f"`{config}`",
                    mode,
                    spread.show(1),
                    cpu_spread.show(1) if cpu_spread else "–",
                    f"{cpu - bare_cpu:+.1f}",
                    f"{bare_cpu / cpu:.2f}x" if cpu else "–",
                    gc_spread.show(1) if gc_spread else "–",
                    f"{statistics.median(result.gc_collections_per_1k):.0f}"
                    if result.gc_collections_per_1k
                    else "–",
                    f"{result.garbage_per_request:.1f}",
                ]
            )
    lines += table(
        [
            "config",
            "mode",
            "µs/req (wall)",
            "CPU µs/req",
            "CPU overhead µs",
            "CPU-implied × bare",
            "GC µs/req",
            "GC runs per 1k req",
            "cyclic garbage objects/req",
        ],
        rows,
    )
    lines.append("")
    leaking = [r for r in micro.values() if r.garbage_types]
    for result in leaking:
        kinds = ", ".join(f"{name} {n:.1f}" for name, n in result.garbage_types)
        lines.append(f"- Cycles left by `{result.config}` ({result.mode}), per request: {kinds}")
    if leaking:
        lines.append("")
    ours = micro.get(("ours-memory", "unique"))
    if ours is not None and ours.garbage_per_request >= 1:
        kinds = ", ".join(name for name, _ in ours.garbage_types)
        runs = statistics.median(ours.gc_collections_per_1k) if ours.gc_collections_per_1k else 0
        lines += [
            f"**Finding:** every request that owns its key still leaves "
            f"{ours.garbage_per_request:.0f} objects in reference cycles ({kinds}). Only the "
            f"cyclic collector frees them, so it runs {runs:.0f} times per 1,000 requests "
            "where bare needs none, and under load each of its full collections pauses the "
            "requests in flight (see the collector under load). Breaking the cycle when the "
            "request settles (the lock renewal's bound method, the context) removes them.",
            "",
        ]
    return lines


# What the profile's top costs are and what is known about them, keyed by a fragment of the
# function's label; a note is printed only when its function is among the measured top costs.
_ROUTE_MATCHING = (
    "The middleware matches the route before the router does (`find_leaf` → "
    "`route.matches`: a regex and a scope copy per route tried), so every guarded request "
    "matches twice. A cache by method and path would save it, but a `Host` or `Mount` can "
    "route one path to two endpoints (issue #13): not done. `python -m bench.ablation` "
    "prices it (`route`)."
)
_WIRE_FORM = (
    "The Redis and PostgreSQL wire form (JSON, ISO-8601 times to the millisecond, the body "
    "inside a JSON string) is what every pod reads during a rolling deploy: a cheaper form "
    "needs a new format version read by both sides first. Times are already formatted and "
    "parsed once per second of the clock."
)
NOTES: dict[str, str] = {
    "asyncio/timeouts.py": (
        "`asyncio.timeout` here is redis-py's own, around each socket read (`socket_timeout`). "
        "The middleware's deadlines do not schedule a timer per call (`_deadlines.py`: one "
        "loop timer checks them all), and a store that never blocks gets none."
    ),
    "dataclasses.py": (
        "`dataclasses.replace()` runs only on the recovery paths (a checkpoint, a takeover); "
        "the records of an ordinary request are built with their constructors."
    ),
    "fastapi/routing.py": _ROUTE_MATCHING,
    ":find_leaf": _ROUTE_MATCHING,
    "secrets.py": (
        "`secrets.token_hex(16)` (an `os.urandom` call) runs on every guarded request, replays "
        "included: the acquire sends the pending record, owner token inside, in the same round "
        "trip that finds a stored answer. `python -m bench.ablation` prices it (`owner token`)."
    ),
    "record_to_dict": _WIRE_FORM,
    "record_from_dict": (
        "A replay parses the whole stored record though it needs only its status, fingerprint, "
        "lease and response. `python -m bench.ablation` prices parsing each record once "
        "(`record decode`)."
    ),
    "stored_response": (
        "`stored_response` decodes and lower-cases each response header once, to drop the "
        "ones a replay must not repeat (hop-by-hop, Date, Server, Set-Cookie)."
    ),
    "redis/utils.py": (
        "redis-py 8 wraps `Redis.set()` in `experimental_args`, which builds a dict of the "
        "call's arguments on every call: the store sends its acquire through "
        "`execute_command` instead (the floor pays the wrapper; mobius, all scripts, does not)."
    ),
    "execute_command": (
        "Most of the Redis path is redis-py itself (`execute_command`: pool checkout, "
        "observability hooks, packing, parsing). The round trips are already minimal: one per "
        "replay, two per first request, as the floor's."
    ),
}


def _cost_rows(costs: Sequence[Cost], total: float, inclusive: bool) -> list[list[str]]:
    rows = []
    for cost in costs[:8]:
        spent = cost.inclusive_us if inclusive else cost.own_us
        share = f"{100 * spent / total:.0f}%" if total else "–"
        rows.append([f"`{cost.function}`", f"{spent:.1f}", share, f"{cost.calls_per_request:.1f}"])
    return rows


def profile_section(profiles: Sequence[ProfileResult]) -> list[str]:
    profiles = [p for p in profiles if p.config.startswith("ours-")]  # peers: the mobius section
    if not profiles:
        return []
    lines = [
        "## Hot-path profile (cProfile, uvicorn in this process under wrk load; "
        f"`{profiles[0].app}` app)",
        "",
        "uvicorn (uvloop, httptools) runs in the profiling process and wrk loads it; the "
        "profiler is on only during the measured wrk run. Times are µs per request *under "
        "the profiler* (which inflates many small calls), so read them as shares. "
        "*Attributed* = the package's own time plus everything it calls outside the package, "
        "except the wrapped app and the server's send/receive (which bare pays too). "
        "Coroutine resumes count as calls; time spent waiting for Redis is not counted. "
        "Full pstats listings are saved beside this report (`profile-*.txt`).",
        "",
    ]
    rows = [
        [
            f"`{p.config}`",
            p.mode,
            f"{p.total_us:.1f}",
            f"{p.package_us:.1f} ({100 * p.package_us / p.total_us:.0f}%)",
            f"{p.package_own_us:.1f} ({100 * p.package_own_us / p.total_us:.0f}%)",
        ]
        for p in profiles
    ]
    lines += table(
        ["config", "mode", "µs/req (profiled)", "attributed to the package", "package own time"],
        rows,
    )
    lines.append("")
    shown: set[str] = set()
    for p in profiles:
        lines += [f"### `{p.config}`, {p.mode}: top costs inside `starlette_idempotency`", ""]
        lines += table(
            ["function (own time)", "µs/req", "share of request", "calls/req"],
            _cost_rows(p.top_package, p.total_us, inclusive=False),
        )
        lines.append("")
        lines += table(
            ["called from the package (inclusive)", "µs/req", "share of request", "calls/req"],
            _cost_rows(p.top_callees, p.total_us, inclusive=True),
        )
        lines.append("")
        for cost in [*p.top_package[:8], *p.top_callees[:8]]:
            shown.update(fragment for fragment in NOTES if fragment in cost.function)
    if shown:
        lines += ["### What is known about the costs above", ""]
        texts = [NOTES[fragment] for fragment in NOTES if fragment in shown]
        lines += [f"- {text}" for text in dict.fromkeys(texts)]
        lines.append("")
    return lines


def pool_section(pool_cost: dict[str, float]) -> list[str]:
    if not pool_cost:
        return []
    plain = pool_cost.get("ConnectionPool", 0.0)
    blocking = pool_cost.get("BlockingConnectionPool", 0.0)
    mobius = pool_cost.get("mobius-redis's ConnectionPool", 0.0)
    lines = [
        "### redis-py connection pools (CPU per command)",
        "",
        "32 concurrent `SET NX PX GET` callers on one client, CPU µs per command (median of "
        "3 trials): redis-py's default `ConnectionPool` (`redis.asyncio.from_url`, "
        "`max_connections=1000`), its `BlockingConnectionPool`, and the pool "
        "mobius-idempotence-library's `RedisBackend` builds (`decode_responses=True`, "
        "`max_connections=50`, `health_check_interval=30`, `retry_on_timeout=True`, 2 s "
        "socket timeouts). The floor and asgi-idempotency-header use the default pool.",
        "",
    ]
    lines += table(
        ["pool", "CPU µs/command"], [[name, f"{value:.1f}"] for name, value in pool_cost.items()]
    )
    lines.append("")
    if plain and blocking > plain:
        lines += [
            f"- The blocking pool costs {blocking - plain:.0f} µs more per command "
            f"({100 * (blocking / plain - 1):.0f}%): its `get_connection` takes an "
            "`asyncio.Condition`, an `async_timeout` and `wait_for` on every checkout.",
        ]
    if plain and mobius:
        lines += [
            f"- mobius's pool settings cost {mobius - plain:+.1f} µs per command against the "
            f"default pool ({100 * (mobius / plain - 1):+.0f}%).",
        ]
    lines.append("")
    return lines


# --- targets ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    measured: str
    met: bool | None  # None: could not be measured
    why: str = ""  # for a missed throughput target: the CPU budget it leaves


def _met(flag: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[flag]


def _ratio_target(
    runs: Runs, config: str, other: str, mode: Mode, minimum: float, label: str
) -> Target:
    spread = runs.ratio(config, other, mode, "rps")
    if spread is None:
        return Target(label, "not measured", None)
    implied = runs.ratio(config, other, mode, "cpu-rate")
    measured = f"{spread.show(2, 'x')} req/s (median of per-round ratios)"
    if implied is not None:
        measured += f"; CPU-implied {implied.median:.2f}x"
    met = spread.median >= minimum
    why = ""
    mine, theirs = runs.values(config, mode, "cpu"), runs.values(other, mode, "cpu")
    if not met and mine is not None and theirs is not None:
        budget = theirs.median + cpu_allowance(theirs.median, minimum)
        why = (
            f"{label}: `{other}` spends {theirs.median:.0f} µs of server CPU per request, so "
            f"the target allows `{config}` at most {budget:.0f} µs; it spends "
            f"{mine.median:.0f} µs, {mine.median - budget:.0f} µs over budget."
        )
    return Target(label, measured, met, why)


def _peers_target(runs: Runs, config: str, mode: Mode, peers: Sequence[str], label: str) -> Target:
    mine = runs.values(config, mode, "rps")
    theirs = {peer: runs.values(peer, mode, "rps") for peer in peers}
    measured = {peer: spread for peer, spread in theirs.items() if spread is not None}
    if mine is None or not measured:
        return Target(label, "not measured", None)
    parts = [f"{peer} {ratio_cell(runs.ratio(config, peer, mode, 'rps'))}" for peer in measured]
    met = all(mine.median > spread.median for spread in measured.values())
    implied = [
        f"{peer} {spread.median:.2f}x"
        for peer in measured
        if (spread := runs.ratio(config, peer, mode, "cpu-rate")) is not None
    ]
    text = f"{mine.median:,.0f} req/s; × " + ", × ".join(parts)
    if implied:
        text += "; CPU-implied × " + ", × ".join(implied)
    return Target(label, text, met)


def _count_target(
    counts: Sequence[ConfigCounts], config: str, case: str, check: Callable[[int], bool], label: str
) -> Target:
    for result in counts:
        if result.config == config and case in result.cases:
            value = result.cases[case].round_trips
            return Target(label, f"{value} ({result.cases[case].describe()})", check(value))
    return Target(label, "not measured", None)


def targets(report: Report) -> list[Target]:
    """Today's targets: load ratios in the ``plain`` app, round trips in any."""
    runs = Runs(report.runs, "plain")
    found: list[Target] = []
    for config in FLOOR_FOR if "plain" in report.apps else ():
        if "plain" not in BY_NAME[config].apps:
            continue
        for mode, minimum in (("unique", RATIO_UNIQUE_VS_FLOOR), ("replay", RATIO_REPLAY_VS_FLOOR)):
            mode_: Mode = "unique" if mode == "unique" else "replay"
            found.append(
                _ratio_target(
                    runs,
                    config,
                    "floor-redis",
                    mode_,
                    minimum,
                    f"`{config}` {mode} ≥ {minimum}x floor-redis req/s",
                )
            )
            found.append(
                _peers_target(
                    runs,
                    config,
                    mode_,
                    PEERS_LIKE_FOR_LIKE["redis"],
                    f"`{config}` {mode} ahead of every peer (Redis backends)",
                )
            )
    found += _memory_targets(runs) if "plain" in report.apps else []
    for config in FLOOR_FOR:
        found.append(
            _count_target(
                report.counts,
                config,
                "first request",
                lambda n: n == 2,
                f"`{config}`: exactly 2 round trips for a first request",
            )
        )
        found.append(
            _count_target(
                report.counts,
                config,
                "replay",
                lambda n: n == 1,
                f"`{config}`: exactly 1 round trip for a replay",
            )
        )
    found = [t for t in found if t.met is not None or "round trip" not in t.name]
    found += _postgres_targets(report)
    return found


def _memory_targets(runs: Runs) -> list[Target]:
    found: list[Target] = []
    found.append(
        _ratio_target(
            runs,
            "ours-memory",
            "bare",
            "unique",
            RATIO_MEMORY_UNIQUE_VS_BARE,
            f"`ours-memory` unique ≥ {RATIO_MEMORY_UNIQUE_VS_BARE}x bare req/s",
        )
    )
    found.append(
        _ratio_target(
            runs,
            "ours-memory",
            "bare",
            "replay",
            RATIO_MEMORY_REPLAY_VS_BARE,
            f"`ours-memory` replay ≥ {RATIO_MEMORY_REPLAY_VS_BARE}x bare req/s",
        )
    )
    for mode_name in ("unique", "replay"):
        mode_m: Mode = "unique" if mode_name == "unique" else "replay"
        found.append(
            _peers_target(
                runs,
                "ours-memory",
                mode_m,
                PEERS_LIKE_FOR_LIKE["memory"],
                f"`ours-memory` {mode_name} ahead of every peer (memory backends; extra)",
            )
        )
    return found


def _postgres_targets(report: Report) -> list[Target]:
    found: list[Target] = []
    found.append(
        _count_target(
            report.counts,
            "ours-postgres",
            "first: acquire",
            lambda n: n <= 2,
            "`ours-postgres`: ≤ 2 statements to acquire (first request)",
        )
    )
    found.append(
        _count_target(
            report.counts,
            "ours-postgres",
            "replay",
            lambda n: n <= 2,
            "`ours-postgres`: ≤ 2 statements to acquire (replay, conflict: insert + read)",
        )
    )
    found.append(
        _count_target(
            report.counts,
            "ours-postgres",
            "first: complete",
            lambda n: n == 1,
            "`ours-postgres`: 1 statement to complete",
        )
    )
    found += _renewal_targets(report.counts)
    return found


def _renewal_targets(counts: Sequence[ConfigCounts]) -> list[Target]:
    found = []
    for result in counts:
        short = next(
            (c for name, c in result.cases.items() if name.startswith("handler 0.2")), None
        )
        long = next((c for name, c in result.cases.items() if name.startswith("handler 0.7")), None)
        first = result.cases.get("first request")
        if short is None or first is None:
            continue
        measured = f"short handler {short.round_trips} vs first request {first.round_trips}" + (
            f"; long handler {long.round_trips} (renewal: {long.describe()})" if long else ""
        )
        found.append(
            Target(
                f"`{result.config}`: lock renewal adds no round trip for a handler < TTL/3",
                measured,
                short.round_trips == first.round_trips,
            )
        )
    return found


def _overhead_lines(report: Report) -> list[str]:
    """Where the unique and replay paths of ours-memory spend beyond bare, in-process."""
    lines = []
    for mode in MODES:
        micro = report.micro.get("plain", {})
        ours, bare = micro.get(("ours-memory", mode)), micro.get(("bare", mode))
        if ours is None or bare is None:
            continue
        gc_us = statistics.median(ours.gc_us_per_request) if ours.gc_us_per_request else 0.0
        lines.append(
            f"- In-process ({mode}): `ours-memory` costs {ours.median:.0f} µs per request "
            f"against bare's {bare.median:.0f} µs ({ours.median - bare.median:+.0f} µs), of "
            f"which {gc_us:.0f} µs is the cyclic garbage collector."
        )
    for profile in report.profiles:
        if not profile.config.startswith("ours-"):
            continue
        top = [*profile.top_package[:3], *profile.top_callees[:3]]
        names = ", ".join(f"`{cost.function.split(':')[-1]}`" for cost in top)
        lines.append(
            f"- Profile `{profile.config}` {profile.mode}: "
            f"{100 * profile.package_us / profile.total_us:.0f}% of the request is attributed "
            f"to the package; largest items: {names}."
        )
    if lines:
        lines.append("")
    return lines


def render(report: Report) -> str:
    meta = report.meta
    runs = Runs(report.runs)
    lines = [
        f"# Benchmark: the cost of being idempotent ({meta.date})",
        "",
        "Reproduce with:",
        "",
        "```",
        meta.command,
        "```",
        "",
        f"Settings: {meta.settings}",
        "",
        "## Machine and versions",
        "",
    ]
    lines += table(["", ""], [[k, v] for k, v in meta.machine.items()])
    lines.append("")
    lines += table(["component", "version"], [[k, v] for k, v in meta.versions.items()])
    lines.append("")
    if meta.notes or report.skipped:
        lines += ["## Notes", ""]
        lines += [f"- {note}" for note in [*meta.notes, *report.skipped]]
        lines.append("")
    lines += ["## Configurations", ""]
    lines += table(
        ["config", "what"],
        [[f"`{name}`", BY_NAME[name].description] for name in runs.configs or BY_NAME],
    )
    lines.append("")
    if report.runs:
        lines += [
            "## Load (uvicorn + wrk)",
            "",
            "Medians over rounds (min–max). Ratios are computed round by round against `bare` "
            "and against the floor of the same round, then the median is taken; for latency a "
            "ratio above 1 is slower. *non-2xx* is wrk's count of statuses above 399. "
            "*Executions / keys issued*: handler executions during the run against the keys "
            "wrk generated (a few in flight at the end may be cut off), with executions beyond "
            "one per key (*dup*, must be 0). RSS is the server's VmRSS after the run (max "
            "over rounds; the endpoint keeps a set of every key it saw, in every configuration). "
            "*Server CPU µs/req* is uvicorn's user+system CPU time over the answered requests; "
            "*CPU-implied × …* is the throughput ratio a CPU-bound worker would get from it "
            "(less sensitive to other load on the machine than req/s). *Store CPU* is the "
            "Redis or PostgreSQL processes' CPU per request. *Foreign CPU %* is the machine's "
            "CPU used during the run by processes outside this benchmark (other people's "
            "work), in % of all cores: high values mean the req/s of that run are disturbed.",
            "",
        ]
        for app in report.apps:
            app_runs = Runs(report.runs, app)
            if not app_runs.configs:
                continue
            lines += [f"### The `{app}` app: {APP_DESCRIPTIONS[app]}", ""]
            for mode in MODES:
                lines += load_section(app_runs, mode, "####")
    lines += ["## Targets" + (" (`plain` app; round trips)" if report.runs else ""), ""]
    found = targets(report)
    lines += table(
        ["target", "measured", "result"], [[t.name, t.measured, _met(t.met)] for t in found]
    )
    lines.append("")
    missed = [t.why for t in found if t.why]
    if missed:
        lines += [
            "### Budgets of the missed throughput targets",
            "",
            "The uvicorn worker is CPU-bound in every run, so a throughput ratio is a CPU "
            "budget per request. Where the excess goes is in the microbenchmark (the "
            "middleware's own cost, and how much of it is garbage collection) and in the "
            "profile below.",
            "",
        ]
        lines += [f"- {why}" for why in missed]
        lines.append("")
        lines += _overhead_lines(report)
    lines += payments_sections(report)
    if report.counts:
        lines += counts_section(report.counts, report.counts_app)
    for app, micro in report.micro.items():
        lines += micro_section(micro, app)
    if report.ablation:
        lines += ["## What each step of a guarded request costs (`bench.ablation`)", ""]
        lines += [report.ablation, ""]
    lines += profile_section(report.profiles)
    lines += pool_section(report.pool_cost)
    if report.fingerprint:
        lines += ["## What `exclude_fields` costs", "", report.fingerprint, ""]
    return "\n".join(lines).rstrip() + "\n"
