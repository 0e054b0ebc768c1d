"""The store as the engine calls it: bounded, observed, and with one kind of failure.

Every call the middleware makes goes through :class:`BoundedStore`, which names its operation
once (for the metrics sink and the tracing span), bounds it to ``store_timeout_seconds``, and
turns whatever it raises into a :class:`~starlette_idempotency.errors.StoreError`. The stores
raise ``StoreError`` for their drivers' failures themselves (they are used on their own too);
what reaches this boundary otherwise is the call's own deadline, or a bug in a custom store,
and the request must still get its 503 or run fail-open rather than a 500.

A call made while other calls wait on the store goes out one turn of the event loop later,
after the work that is ready then: the calls of requests that became ready together (a burst
of requests read in one turn, or the store's answers to them) then reach the store's server
one behind another, and it serves them in one wake-up rather than one each. Waking a server
that sleeps costs the writer's ``write()`` an interrupt to another core and the server a turn
of its own loop, more than a Redis command itself: at 32 requests in flight this cut the
worker's system time per new key on Redis by a third and raised its rate, against the
peers', by about a fifth (docs/explanation/benchmarks.md#calls-sent-together). A call made
alone goes out at once: there is nothing to send it with, and one request's latency stays
its own. The turn counts within the call's deadline and its duration metric. A store that
sends a turn's calls together itself (``CallBatchingStore``: ``RedisStore`` on redis-py, in
one pipeline) has every call sent at once: the turn would only delay its batch by one.

It also speaks the protocol of 0.1 to a store written for it (its ``save_progress`` takes no
``lease``): for such a store alone, leases are set and judged on the middleware's clock, as
they were, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, ParamSpec, Protocol, TypeVar

from starlette_idempotency._deprecation import deprecated
from starlette_idempotency._record import IdempotencyRecord, RecordStatus
from starlette_idempotency._timers import CallsInFlight, PerLoop
from starlette_idempotency._types import Clock, system_clock
from starlette_idempotency.errors import StoreError, StoreTimeoutError
from starlette_idempotency.observability import MetricsSink, StoreCallTracer
from starlette_idempotency.stores.base import (
    FINISH_SPELLINGS,
    AcquireResult,
    CallBatchingStore,
    FencedWrite,
    IdempotencyStore,
    StoreBase,
    leases_on_store_clock,
    renews_retention,
    take_back,
)

_T = TypeVar("_T")
_P = ParamSpec("_P")


class _StoreCall(Protocol):
    """A store call made, bounded and observed: ``method(*args, **kwargs)`` as ``operation``."""

    def __call__(
        self,
        operation: str,
        method: Callable[_P, Awaitable[_T]],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> Awaitable[_T]: ...


#: :meth:`IdempotencyStore.finish`'s signature.
Finish = Callable[[str, IdempotencyRecord, float], Awaitable[FencedWrite]]


class TryAcquire(Protocol):
    """:meth:`IdempotencyStore.try_acquire`'s signature, bounded."""

    def __call__(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> Awaitable[AcquireResult]: ...


#: The operations store calls are timed and traced as (``finish`` as the outcome it writes).
OBSERVED_OPERATIONS = (
    "try_acquire",
    *FINISH_SPELLINGS.values(),
    "save_progress",
    "release",
    "renew",
    "get",
)


class BoundedStore:
    """The store's primitives, each bounded to ``timeout`` seconds, timed and traced."""

    __slots__ = (
        "_call",
        "_clock",
        "_defers",
        "_in_flight",
        "_legacy_leases",
        "_metrics",
        "_renews_retention",
        "_tracer",
        "finish_for",
        "name",
        "store",
        "timeout",
        "try_acquire",
    )

    #: A call of the store, bounded (and, with a metrics sink or tracing, observed).
    _call: _StoreCall

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        timeout: float,
        metrics: MetricsSink | None,
        tracer: StoreCallTracer | None,
        clock: Clock = system_clock,
    ) -> None:
        self.store = store
        self._clock = clock
        self._legacy_leases = not leases_on_store_clock(store)
        self._renews_retention = renews_retention(store)
        if self._legacy_leases and store.supports_recovery:
            deprecated(
                f"{type(store).__name__}.save_progress takes no lease: it implements the store "
                "protocol of 0.1, so its recovery leases are set and judged on each pod's "
                "clock, and pods whose clocks disagree can run a handler twice. Give "
                "save_progress a lease parameter (seconds, counted on the store's clock) and "
                "set AcquireResult.lease_expired; the 0.1 protocol",
                stacklevel=3,
            )
        #: The store's name for metrics labels and spans.
        self.name = store.name
        #: How long a call may take, in seconds (``store_timeout_seconds``).
        self.timeout = timeout
        self._in_flight = PerLoop(lambda loop: CallsInFlight(loop, timeout))
        #: Whether a call made while others wait goes out a turn later (see the module docs).
        self._defers = not (isinstance(store, CallBatchingStore) and store.batches_calls)
        self._metrics = metrics
        self._tracer = tracer
        # Bounded, and where there is a sink or tracing, observed: chosen once, not per call.
        self._call = self._bounded if metrics is None and tracer is None else self._observed
        # The engine's hot calls are partials of _call, so no frame of ours sits around the
        # bounding one (their arguments are _call's, which mypy cannot apply in part).
        call: Callable[..., Any] = self._call
        #: The store's ``try_acquire``, bounded.
        self.try_acquire: TryAcquire = functools.partial(
            call,
            "try_acquire",
            self._lease_judged_here if self._legacy_leases else store.try_acquire,
        )
        # A store written for the protocol's first spelling overrides complete() or fail()
        # rather than finish(): it gets those calls, as it did, until 0.3.0.
        finishers = {
            status: getattr(store, spelling)
            for status, spelling in FINISH_SPELLINGS.items()
            if getattr(type(store), spelling, None) not in (None, getattr(StoreBase, spelling))
        }
        if finishers:
            overridden = " and ".join(f"{FINISH_SPELLINGS[s]}()" for s in finishers)
            deprecated(
                f"{type(store).__name__} overrides {overridden}, the protocol's first spelling "
                "of finish(): the middleware calls it, but override finish() instead",
                stacklevel=4,
            )
        #: The store's ``finish`` of a record in each final status, bounded, and named for the
        #: outcome it writes, as metrics and spans (and the dashboards built on them) name it.
        self.finish_for: dict[RecordStatus, Finish] = {
            status: functools.partial(call, spelling, finishers.get(status, store.finish))
            for status, spelling in FINISH_SPELLINGS.items()
        }

    async def _lease_judged_here(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        """A 0.1 store's answer, with ``lease_expired`` judged on this pod's clock."""
        result = await self.store.try_acquire(key, pending, lock_ttl, recover=recover)
        if result.acquired or result.record is None or result.lease_expired is not None:
            return result
        return replace(result, lease_expired=result.record.lease_expired(self._clock()))

    def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> Awaitable[bool]:
        if self._legacy_leases:
            dated = replace(record, locked_until=self._clock() + lease)
            legacy: Callable[..., Awaitable[bool]] = self.store.save_progress
            return self._call("save_progress", legacy, key, dated, ttl)
        return self._call("save_progress", self.store.save_progress, key, record, ttl, lease)

    def release(self, key: str, owner_token: str) -> Awaitable[bool]:
        return self._call("release", self.store.release, key, owner_token)

    def renew(
        self, key: str, record: IdempotencyRecord, lock_ttl: float, ttl: float
    ) -> Awaitable[bool]:
        """Extend the lock of ``record`` (its lease, when it has recovery points, the record
        then kept for ``ttl`` from now, where the store takes it: see ``renews_retention``): a
        0.1 store renews such a lease by saving the record again."""
        if self._legacy_leases and record.checkpoints:
            return self.save_progress(key, record, ttl, lock_ttl)
        if self._renews_retention:
            renew: Callable[..., Awaitable[bool]] = self.store.renew
            return self._call("renew", renew, key, record.owner_token, lock_ttl, ttl=ttl)
        return self._call("renew", self.store.renew, key, record.owner_token, lock_ttl)

    def take_back(
        self, key: str, record: IdempotencyRecord, lock_ttl: float
    ) -> Awaitable[AcquireResult]:
        """:func:`~starlette_idempotency.stores.base.take_back` on the store, bounded, and
        counted as ``try_acquire``, which it is."""
        return self._call("try_acquire", take_back, self.store, key, record, lock_ttl)

    def get(self, key: str) -> Awaitable[IdempotencyRecord | None]:
        return self._call("get", self.store.get, key)

    async def _observed(
        self,
        operation: str,
        method: Callable[_P, Awaitable[_T]],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """:meth:`_bounded`, timed for the metrics sink and traced as a span."""
        started = time.perf_counter()
        ok = False
        try:
            if self._tracer is None:
                result = await self._bounded(operation, method, *args, **kwargs)
            else:
                with self._tracer.span(self.name, operation):
                    result = await self._bounded(operation, method, *args, **kwargs)
            ok = True
            return result
        finally:
            if self._metrics is not None:
                self._metrics.observe_store_call(
                    self.name, operation, time.perf_counter() - started, ok
                )

    async def _bounded(
        self,
        operation: str,
        method: Callable[_P, Awaitable[_T]],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """``method(*args, **kwargs)``'s result, its failures (raised as it is called, too) as
        ``StoreError``, and ``StoreTimeoutError`` once it is late (see ``CallsInFlight``:
        nothing is made per call). Made while other calls are in flight, it goes out a turn of
        the loop later (see the module docs)."""
        task = asyncio.current_task()
        assert task is not None, "a coroutine awaited under asyncio runs in a task"
        loop = task.get_loop()
        in_flight = self._in_flight.last
        if in_flight is None or in_flight.loop is not loop:
            in_flight = self._in_flight.get(loop)
        cancelling = task.cancelling()
        due = in_flight.due
        others_waiting = self._defers and bool(due)
        due[task] = loop.time() + self.timeout
        if in_flight.handle is None:
            in_flight.arm()
        try:
            if others_waiting:  # sent beside the calls ready with it (see the module docs)
                await asyncio.sleep(0)
            return await method(*args, **kwargs)
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"idempotency store call {operation} failed: {exc!r}") from exc
        except asyncio.CancelledError as exc:
            late = in_flight.late
            if task in late:
                late.discard(task)
                # Ours to take back; a cancellation beyond ours (someone else's) stays one.
                if task.uncancel() <= cancelling:
                    raise StoreTimeoutError(
                        f"idempotency store call {operation} took longer than {self.timeout}s"
                    ) from exc
            raise
        finally:
            del in_flight.due[task]
            if task in in_flight.late:  # cancelled when late, but the call swallowed it
                in_flight.late.discard(task)
                task.uncancel()
