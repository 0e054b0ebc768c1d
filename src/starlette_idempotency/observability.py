"""What the middleware decided, told to logs, an optional hook and optional metrics.

Every guarded request emits one ``idempotency_check`` event when the decision is taken, and
every request that acquired its key one ``idempotency_outcome`` event when it ends. Events go to
the ``starlette_idempotency`` logger at INFO as ``extra`` fields (any JSON formatter shows them),
to ``on_event`` if given, and to a :class:`MetricsSink` if given. None of it can fail a request.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

logger = logging.getLogger("starlette_idempotency")

KeyLogging = Literal["raw", "hashed"]


class CheckResult(enum.StrEnum):
    """How the middleware answered a guarded request."""

    ACQUIRED = "ACQUIRED"
    REPLAYED = "REPLAYED"
    CONFLICT = "CONFLICT"
    MISMATCH = "MISMATCH"
    MISSING_KEY = "MISSING_KEY"
    INVALID_KEY = "INVALID_KEY"
    TOO_LARGE = "TOO_LARGE"
    INVALID_BODY = "INVALID_BODY"
    INVALID_REQUEST = "INVALID_REQUEST"
    STORE_ERROR = "STORE_ERROR"
    FAIL_OPEN = "FAIL_OPEN"
    REQUIRES_RECOVERY = "REQUIRES_RECOVERY"
    SCOPE_REFUSED = "SCOPE_REFUSED"


class OutcomeResult(enum.StrEnum):
    """What became of a request that acquired its key."""

    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    RELEASED = "RELEASED"
    LOCK_LOST = "LOCK_LOST"


@dataclass(frozen=True, slots=True)
class IdempotencyEvent:
    """One decision or outcome, as logged and as passed to ``on_event``."""

    event: Literal["idempotency_check", "idempotency_outcome"]
    idempotency_key: str | None
    endpoint: str
    result: str
    pod_id: str
    duration_ms: float
    status_code: int | None = None
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


EventHook = Callable[[IdempotencyEvent], "Awaitable[None] | None"]
"""Receives every event; sync or async. Exceptions it raises are logged and ignored."""


#: Why a lock ran out (or may have), as ``observe_processing_timeout`` is told: lost, found
#: gone, taken over; ``event_loop_blocked`` (a loop blocked for half a lock's TTL) and
#: ``max_processing_seconds`` (a hung handler's renewal ended). Each is declared at zero, so
#: that the first one of a pod is an increase an alert sees.
PROCESSING_TIMEOUT_REASONS = (
    "lock_lost",
    "renewal_found_gone",
    "complete_found_gone",
    "expired_lease_taken_over",
    "event_loop_blocked",
    "max_processing_seconds",
)


class MetricsSink(Protocol):
    """Where counters and timings go (see :class:`~starlette_idempotency.PrometheusMetrics`).

    Two methods are optional, called when the sink has them: ``declare(endpoints, store)``
    once the routes are known (at startup, or at the first request without a lifespan), with
    every guarded ``"METHOD /template"`` and the store's name, so that counters can exist at
    zero before anything happens; and ``observe_waiting(delta)`` when a duplicate starts
    (``+1``) or stops (``-1``) waiting for the first request (``on_in_progress="wait"``).
    """

    def observe_event(self, event: IdempotencyEvent) -> None:
        """Count a check or outcome event."""

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        """Time one store call and count it as an error unless ``ok``."""

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        """Count a lock that ran out: lost, found gone on renewal, or taken over."""


class _SinkThatCannotFail:
    """A metrics sink's calls, none of whose failures reaches the request: a sink that raises
    (its backend down, a label it refuses) must not fail the request it counts, nor interrupt
    the write it times (which would then be made again). The first failure of each method is
    logged, and the next once it has worked again in between."""

    def __init__(self, sink: MetricsSink) -> None:
        self._sink = sink
        self._observe_waiting = getattr(sink, "observe_waiting", None)
        self._failing: set[str] = set()

    def _call(self, name: str, method: Callable[..., object], *args: Any) -> None:
        try:
            method(*args)
        except Exception:
            if name not in self._failing:
                self._failing.add(name)
                logger.exception(
                    "the metrics sink's %s() failed; requests go on, and its next failures "
                    "are not logged until it works again",
                    name,
                )
            return
        if self._failing:
            self._failing.discard(name)

    def observe_event(self, event: IdempotencyEvent) -> None:
        self._call("observe_event", self._sink.observe_event, event)

    def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
        self._call(
            "observe_store_call", self._sink.observe_store_call, store, operation, seconds, ok
        )

    def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
        self._call(
            "observe_processing_timeout", self._sink.observe_processing_timeout, endpoint, reason
        )

    def observe_waiting(self, delta: int) -> None:
        if self._observe_waiting is not None:
            self._call("observe_waiting", self._observe_waiting, delta)


class Observer:
    """Fans events out to the logger, the hook and the metrics sink."""

    def __init__(
        self,
        *,
        pod_id: str | None,
        log_keys: KeyLogging,
        on_event: EventHook | None,
        metrics: MetricsSink | None,
    ) -> None:
        self.pod_id = pod_id or socket.gethostname()
        self._hash_keys = log_keys == "hashed"
        self._on_event = on_event
        #: The metrics sink, whose failures are logged, not raised.
        self.metrics = None if metrics is None else _SinkThatCannotFail(metrics)
        #: Whether a hook or a metrics sink takes every event (the logger may, at INFO).
        self.listens = on_event is not None or metrics is not None
        self._declare = getattr(metrics, "declare", None)

    @property
    def wants_events(self) -> bool:
        """False when nobody listens: then the middleware builds no event at all."""
        return self.listens or logger.isEnabledFor(logging.INFO)

    def shown_key(self, key: str | None) -> str | None:
        """``key`` as events and log messages show it (``log_keys``)."""
        if key is None or not self._hash_keys:
            return key
        return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:32]

    def shown_error(self, exc: BaseException) -> str:
        """A store error as log messages show it: its message names the storage key, which
        holds the key, so under ``log_keys="hashed"`` only its type and cause are shown."""
        return error_summary(exc) if self._hash_keys else str(exc)

    async def emit(
        self,
        kind: Literal["idempotency_check", "idempotency_outcome"],
        *,
        key: str | None,
        endpoint: str,
        result: CheckResult | OutcomeResult,
        duration_ms: float,
        status_code: int | None = None,
        note: str | None = None,
    ) -> None:
        event = IdempotencyEvent(
            event=kind,
            idempotency_key=self.shown_key(key),
            endpoint=endpoint,
            result=result.value,
            pod_id=self.pod_id,
            duration_ms=round(duration_ms, 3),
            status_code=status_code,
            note=note,
        )
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s %s %s", kind, endpoint, event.result, extra=event.as_dict())
        if self.metrics is not None:
            self.metrics.observe_event(event)
        if self._on_event is not None:
            try:
                outcome = self._on_event(event)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:
                logger.exception("on_event hook failed; the request goes on")

    def processing_timeout(self, endpoint: str, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_processing_timeout(endpoint, reason)

    def declare(self, endpoints: Iterable[str], store: str) -> None:
        """Tell the metrics sink the guarded endpoints and the store, once they are known."""
        if self._declare is not None:
            try:
                self._declare(list(endpoints), store)
            except Exception:
                logger.exception("the metrics sink's declare() failed; the app goes on")

    def waiting(self, delta: int) -> None:
        """One more (``+1``) or one fewer (``-1``) duplicate waiting for a first request."""
        if self.metrics is not None:
            self.metrics.observe_waiting(delta)


def error_summary(exc: BaseException) -> str:
    """An error's type and its cause's (a driver's error: a refused connection, a timeout),
    without its own message, which may name a key."""
    cause = exc.__cause__
    if cause is None:
        return type(exc).__name__
    return f"{type(exc).__name__} ({type(cause).__name__}: {cause})"


class StoreCallTracer:
    """Wraps store calls in OpenTelemetry spans when ``opentelemetry-api`` is installed."""

    def __init__(self) -> None:
        try:
            from opentelemetry import trace
        except ImportError as exc:
            raise ImportError(
                "tracing=True needs OpenTelemetry: pip install opentelemetry-api"
            ) from exc
        self._tracer = trace.get_tracer("starlette_idempotency")

    def span(self, store: str, operation: str) -> AbstractContextManager[Any]:
        return self._tracer.start_as_current_span(
            f"idempotency.store.{operation}",
            attributes={"idempotency.store": store, "idempotency.operation": operation},
        )


class RequestEvents:
    """Reports one request's check and outcome to the observer, timed from its start."""

    __slots__ = ("_observer", "_started", "endpoint", "key")

    def __init__(self, observer: Observer, method: str, template: str) -> None:
        self._observer = observer
        #: ``"POST /payments"``: the method and the route's template.
        self.endpoint = f"{method} {template}"
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

    async def decided(self, result: CheckResult, note: str | None = None) -> None:
        """What the middleware decided before the app ran (or instead of running it)."""
        if self._observer.listens or logger.isEnabledFor(logging.INFO):
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
        if self._observer.listens or logger.isEnabledFor(logging.INFO):
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
