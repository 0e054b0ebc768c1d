"""Benchmarks for starlette-idempotency: the cost of being idempotent.

``python -m bench`` measures real uvicorn servers under ``wrk`` load (no middleware, a
hand-written floor, this library with each store, and peer libraries), counts store round trips
from the servers' side, runs an in-process microbenchmark and profiles the hot path, then writes
a markdown report to ``bench/results/``. See ``python -m bench --help``.
"""

from __future__ import annotations
