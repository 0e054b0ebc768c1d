"""The cyclic garbage collector's pauses inside a benchmarked server, by generation.

:class:`GcWatch` is a ``gc.callbacks`` hook: it times every collection (the collector calls it
before and after each one) and keeps, per generation, the count, the total and the longest
pause, and every full (generation 2) pause. The server serves the counters at ``GET /__gc``;
the harness reads them before and after a wrk run and keeps the difference
(:meth:`GcSnapshot.since`), so the pauses are those of the measured window only.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

_KEPT_FULL_PAUSES = 100_000  # far more than a run makes (a handful per second at most)


@dataclass(frozen=True, slots=True)
class GcSnapshot:
    """Cumulative counters (or, from :meth:`since`, those of one window)."""

    collections: tuple[int, int, int] = (0, 0, 0)
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    full_pauses_ms: tuple[float, ...] = ()  # every generation-2 pause, in order

    def since(self, before: GcSnapshot) -> GcSnapshot:
        """What happened between ``before`` and this snapshot."""
        return GcSnapshot(
            collections=_sub3(self.collections, before.collections),
            seconds=_sub3f(self.seconds, before.seconds),
            full_pauses_ms=self.full_pauses_ms[len(before.full_pauses_ms) :],
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "collections": list(self.collections),
            "seconds": list(self.seconds),
            "full_pauses_ms": list(self.full_pauses_ms),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GcSnapshot:
        c, s = data["collections"], data["seconds"]
        return cls(
            collections=(int(c[0]), int(c[1]), int(c[2])),
            seconds=(float(s[0]), float(s[1]), float(s[2])),
            full_pauses_ms=tuple(float(ms) for ms in data["full_pauses_ms"]),
        )


def _sub3(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def _sub3f(
    a: tuple[float, float, float], b: tuple[float, float, float]
) -> tuple[float, float, float]:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


@dataclass
class GcWatch:
    """Times each collection; install with :meth:`install` (once per process)."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    full_pauses_ms: list[float] = field(default_factory=list)
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._started
        generation = int(info.get("generation", 0))
        self.collections[generation] += 1
        self.seconds[generation] += elapsed
        if generation == 2 and len(self.full_pauses_ms) < _KEPT_FULL_PAUSES:
            self.full_pauses_ms.append(elapsed * 1000)

    def install(self) -> GcWatch:
        if not any(callback is self for callback in gc.callbacks):
            gc.callbacks.append(self)
        return self

    def snapshot(self) -> GcSnapshot:
        c, s = self.collections, self.seconds
        return GcSnapshot((c[0], c[1], c[2]), (s[0], s[1], s[2]), tuple(self.full_pauses_ms))
