"""One guarded request's events: what was decided about it, and how it ended."""

from __future__ import annotations

import time

from starlette_idempotency.observability import CheckResult, Observer, OutcomeResult


class RequestEvents:
    """Reports one request's check and outcome to the observer, timed from its start."""

    __slots__ = ("_method", "_observer", "_started", "_template", "key")

    def __init__(self, observer: Observer, method: str, template: str) -> None:
        self._observer = observer
        self._method = method
        self._template = template
        self._started = time.perf_counter()
        #: The request's idempotency key, once it was read and found valid.
        self.key: str | None = None

    @property
    def shown_key(self) -> str | None:
        """The key as log messages may show it (``log_keys``)."""
        return self._observer.shown_key(self.key)

    def shown_error(self, exc: BaseException) -> str:
        """A store error as log messages may show it (``log_keys``)."""
        return self._observer.shown_error(exc)

    @property
    def endpoint(self) -> str:
        """``"POST /payments"``: the method and the route's template."""
        return f"{self._method} {self._template}"

    async def decided(self, result: CheckResult, note: str | None = None) -> None:
        """What the middleware decided before the app ran (or instead of running it)."""
        if self._observer.wants_events:
            await self._observer.emit(
                "idempotency_check",
                key=self.key,
                endpoint=self.endpoint,
                result=result,
                duration_ms=self._elapsed_ms(),
                note=note,
            )

    async def ended(
        self, result: OutcomeResult, status_code: int | None, note: str | None = None
    ) -> None:
        """How the request that owned its key ended."""
        if self._observer.wants_events:
            await self._observer.emit(
                "idempotency_outcome",
                key=self.key,
                endpoint=self.endpoint,
                result=result,
                duration_ms=self._elapsed_ms(),
                status_code=status_code,
                note=note,
            )

    def processing_timeout(self, reason: str) -> None:
        """Count a lock that ran out (lost, found gone, or taken over) as ``reason``."""
        self._observer.processing_timeout(self.endpoint, reason)

    async def lock_lost(self, reason: str, note: str, status_code: int | None = None) -> None:
        """A lock that vanished or was taken over: a ``LOCK_LOST`` outcome with ``note``
        ("reclaimed" or "taken_over") and a processing timeout counted as ``reason``."""
        self.processing_timeout(reason)
        await self.ended(OutcomeResult.LOCK_LOST, status_code, note)

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self._started) * 1000
