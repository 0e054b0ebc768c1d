"""Counting a handler's runs by idempotency key, to assert that a retry did not run it again."""

from __future__ import annotations

import threading
from collections import Counter

from starlette.requests import HTTPConnection

from starlette_idempotency._types import DEFAULT_HEADER_NAME


class Executions:
    """How many times a handler ran for each idempotency key.

    The handler, or the fake it calls for its side effect, records each run; the test then
    asserts. Runs of requests without the header count under ``None``::

        executions = Executions()

        async def charge(key: str, amount: int) -> str:  # the fake payment provider
            executions.record(key)
            ...

        executions.assert_ran_once("key-1")
    """

    def __init__(self, header_name: str = DEFAULT_HEADER_NAME) -> None:
        self.header_name = header_name
        self._counts: Counter[str | None] = Counter()
        self._lock = threading.Lock()  # sync endpoints run in a thread pool

    def record(self, request_or_key: HTTPConnection | str | None) -> None:
        """Count one run for a key, or for the key in a request's header."""
        key = (
            request_or_key.headers.get(self.header_name)
            if isinstance(request_or_key, HTTPConnection)
            else request_or_key
        )
        with self._lock:
            self._counts[key] += 1

    def count(self, key: str | None) -> int:
        """How many runs were recorded for ``key``."""
        with self._lock:
            return self._counts[key]

    @property
    def total(self) -> int:
        """How many runs were recorded, whatever their key."""
        with self._lock:
            return self._counts.total()

    def assert_ran_once(self, key: str | None) -> None:
        """Fail unless exactly one run was recorded for ``key``."""
        __tracebackhide__ = True
        self.assert_ran_times(key, 1)

    def assert_ran_times(self, key: str | None, times: int) -> None:
        """Fail unless exactly ``times`` runs were recorded for ``key`` (0: it never ran)."""
        __tracebackhide__ = True
        with self._lock:
            ran = self._counts[key]
            by_key = {k: n for k, n in self._counts.items() if n}
        if ran != times:
            which = "without a key" if key is None else f"for {self.header_name} {key!r}"
            raise AssertionError(
                f"expected {_runs(times, exactly=True)} of the handler {which}, got {_runs(ran)}; "
                f"runs by key: {by_key}"
            )


def _runs(count: int, *, exactly: bool = False) -> str:
    if count == 0:
        return "no run"
    if count == 1:
        return "exactly one run" if exactly else "one run"
    return f"{count} runs"


__all__ = ["Executions"]
