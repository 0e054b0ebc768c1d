"""Benchmarks for starlette-idempotency: the cost of being idempotent.

``python -m bench`` loads real uvicorn servers with ``wrk`` (no middleware, a hand-written
floor, this library with each store, and peer libraries), samples the worker with py-spy,
and awaits the app in-process; it prints a markdown summary. See ``python -m bench --help``.
"""

from __future__ import annotations
