"""The report's data and the helpers its sections share: the run's results (:class:`Report`),
spreads over rounds, per-round lookups over the load runs, and markdown tables.

:mod:`bench.report` and :mod:`bench.report_payments` both build their sections on these.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bench.configs import AppName
from bench.load import Mode, RunResult
from bench.micro import MicroResult, ProfileResult
from bench.roundtrips import ConfigCounts


@dataclass
class Meta:
    date: str
    command: str
    settings: str
    versions: dict[str, str]
    machine: dict[str, str]
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    meta: Meta
    runs: list[RunResult] = field(default_factory=list)
    counts: list[ConfigCounts] = field(default_factory=list)
    # per app: (config, mode) -> result
    micro: dict[AppName, dict[tuple[str, Mode], MicroResult]] = field(default_factory=dict)
    profiles: list[ProfileResult] = field(default_factory=list)
    pool_cost: dict[str, float] = field(default_factory=dict)  # redis-py pool, CPU µs/command
    fingerprint: str = ""  # bench.fingerprint's table: what exclude_fields costs
    ablation: str = ""  # bench.ablation's table: what each step of a guarded request costs
    skipped: list[str] = field(default_factory=list)
    apps: list[AppName] = field(default_factory=lambda: ["plain"])
    counts_app: AppName = "plain"  # the app the round trips and the profile ran on
    prefills: list[dict[str, object]] = field(default_factory=list)  # bench.prefill answers


# --- numbers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values))

    def show(self, digits: int = 0, suffix: str = "") -> str:
        def fmt(value: float) -> str:
            return f"{value:,.{digits}f}{suffix}"

        if len(set((self.low, self.high))) == 1:
            return fmt(self.median)
        return f"{fmt(self.median)} ({fmt(self.low)}–{fmt(self.high)})"


def _metric(run: RunResult, name: str) -> float:
    if name == "cpu-rate":  # requests per CPU second of the server: higher is better
        return 1e6 / run.server_cpu_us if run.server_cpu_us else 0.0
    return {
        "rps": run.wrk.rps,
        "p50": run.wrk.p50_ms,
        "p99": run.wrk.p99_ms,
        "cpu": run.server_cpu_us,
        "store-cpu": run.store_cpu_us,
        "foreign": run.foreign_cpu_pct,
    }[name]


class Runs:
    """Per-round lookups over the load runs (of one app, when ``app`` is given)."""

    def __init__(self, runs: Iterable[RunResult], app: AppName | None = None) -> None:
        self._by_key = {(r.config, r.mode, r.round): r for r in runs if app is None or r.app == app}
        self.configs = list(dict.fromkeys(r.config for r in self._by_key.values()))
        self.rounds = sorted({r.round for r in self._by_key.values()})

    def of(self, config: str, mode: Mode) -> list[RunResult]:
        return [self._by_key[k] for k in sorted(self._by_key) if k[0] == config and k[1] == mode]

    def values(self, config: str, mode: Mode, metric: str) -> Spread | None:
        return Spread.of([_metric(run, metric) for run in self.of(config, mode)])

    def ratio(self, config: str, other: str, mode: Mode, metric: str) -> Spread | None:
        """``config``'s metric over ``other``'s, round by round (same round only)."""
        ratios = []
        for round_number in self.rounds:
            mine = self._by_key.get((config, mode, round_number))
            theirs = self._by_key.get((other, mode, round_number))
            if mine is not None and theirs is not None and _metric(theirs, metric):
                ratios.append(_metric(mine, metric) / _metric(theirs, metric))
        return Spread.of(ratios)


def cpu_allowance(baseline_cpu_us: float, least_ratio: float) -> float:
    """µs of server CPU per request a CPU-bound worker may spend on top of its baseline's and
    still answer at ``least_ratio`` times the baseline's rate."""
    return baseline_cpu_us * (1 / least_ratio - 1)


def ratio_cell(spread: Spread | None) -> str:
    return "–" if spread is None else spread.show(2, "x")


# --- tables -------------------------------------------------------------------------------


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines
