"""A store that fails or stalls on demand, for testing how an app copes with its store.

:class:`FaultyStore` wraps a real store. Until told otherwise every call goes straight through;
then chosen operations raise (:meth:`~FaultyStore.fail_next`, :meth:`~FaultyStore.fail_always`)
or wait until a block ends (:meth:`~FaultyStore.stall`)::

    store = FaultyStore(MemoryStore())
    app.add_middleware(IdempotencyMiddleware, store=store, store_timeout_seconds=0.1)

    store.fail_next("try_acquire")            # the next request gets a 503
    async with store.stall("finish"):        # storing responses meanwhile hits the timeout
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency.errors import StoreError
from starlette_idempotency.stores.base import (
    FINISH_SPELLINGS,
    STORE_OPERATIONS,
    AcquireResult,
    FencedWrite,
    IdempotencyStore,
    StoreBase,
    leases_on_store_clock,
    renews_retention,
)

_T = TypeVar("_T")


class Stall:
    """The calls one :meth:`FaultyStore.stall` block holds back until it ends."""

    def __init__(self, operations: frozenset[str]) -> None:
        #: The operations it holds (every operation when empty).
        self.operations = operations
        #: How many calls it has held so far.
        self.calls = 0
        self._arrived = asyncio.Event()
        self._released = asyncio.Event()

    def holds(self, operation: str) -> bool:
        return not self.operations or operation in self.operations

    async def wait_for_calls(self, count: int = 1) -> None:
        """Return once ``count`` calls are held: the code under test has reached the store."""
        while self.calls < count:
            self._arrived.clear()
            await self._arrived.wait()

    async def _hold(self) -> None:
        self.calls += 1
        self._arrived.set()
        await self._released.wait()

    def _release(self) -> None:
        self._released.set()


@dataclass
class _Failure:
    error: Exception
    remaining: int | None  # None: until healed


class FaultyStore(StoreBase):
    """A store that passes every call to ``store`` until told to fail or stall some.

    An operation is one of the store's async methods, by name: the protocol's ``try_acquire``,
    ``finish``, ``save_progress``, ``release``, ``renew``, ``get`` and ``aclose``,
    and those the wrapped store adds (``wait_for_change``, ``check``, ``create_schema`` ...).
    ``complete`` and ``fail`` name ``finish`` for a ``Completed`` or a ``Failed`` record (the
    protocol's first spelling), and ``resolve`` is built on ``get`` and ``finish``. Its other
    methods and attributes are the wrapped store's, so the wrapper has the same capabilities:
    ``supports_recovery``, change notifications, the startup check. ``calls`` counts the calls
    of each operation.
    """

    #: The wrapped store is whoever made it's to close, never the middleware's.
    owns_connections = False

    def __init__(self, store: IdempotencyStore) -> None:
        self.inner = store
        self.name = store.name
        self.supports_recovery = store.supports_recovery
        self.calls: Counter[str] = Counter()
        self._failures: dict[str, _Failure] = {}
        self._stalls: list[Stall] = []
        operations = {*STORE_OPERATIONS, *FINISH_SPELLINGS.values()}
        # Instance attributes, not __getattr__: isinstance() against a runtime-checkable
        # protocol looks attributes up statically on Python 3.12+.
        for name in dir(type(store)):
            if name.startswith("_") or hasattr(FaultyStore, name) or name in vars(self):
                continue
            if not inspect.isfunction(inspect.getattr_static(type(store), name)):
                continue
            method = getattr(store, name)
            if inspect.iscoroutinefunction(method):
                operations.add(name)
                method = self._faulty(name, method)
            setattr(self, name, method)
        if not leases_on_store_clock(store):
            # A store of the 0.1 protocol: the wrapper keeps its save_progress signature, so
            # the middleware still speaks that protocol to it.
            self.save_progress = self._faulty("save_progress", store.save_progress)  # type: ignore[method-assign]
        #: The names :meth:`fail_next`, :meth:`fail_always` and :meth:`stall` accept.
        self.operations = frozenset(operations)

    def __getattr__(self, name: str) -> Any:
        """The wrapped store's other attributes (``__init__`` bound its methods already)."""
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"

    # --- choosing faults ----------------------------------------------------------------------

    def fail_next(self, operation: str, error: Exception | None = None, *, times: int = 1) -> None:
        """Make the next ``times`` calls of ``operation`` raise ``error`` (by default a
        :class:`~starlette_idempotency.StoreError`, what a store that lost its server raises)."""
        if times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        self._failures[self._checked(operation)] = _Failure(self._error(operation, error), times)

    def fail_always(self, operation: str, error: Exception | None = None) -> None:
        """Make every call of ``operation`` raise ``error`` until :meth:`heal`."""
        self._failures[self._checked(operation)] = _Failure(self._error(operation, error), None)

    def heal(self, operation: str | None = None) -> None:
        """Stop the failures of ``operation`` (of every operation by default)."""
        if operation is None:
            self._failures.clear()
        else:
            self._failures.pop(self._checked(operation), None)

    @contextlib.asynccontextmanager
    async def stall(self, *operations: str) -> AsyncIterator[Stall]:
        """Hold every call of ``operations`` (of any operation when none is named) made inside
        the block until the block ends; then the calls go on, unless their caller gave up
        (the middleware's store timeout cancels them)."""
        stall = Stall(frozenset(self._checked(operation) for operation in operations))
        self._stalls.append(stall)
        try:
            yield stall
        finally:
            self._stalls.remove(stall)
            stall._release()

    def _checked(self, operation: str) -> str:
        if operation == "resolve":
            raise ValueError("'resolve' is built on 'get' and 'finish': fault one of those")
        if operation not in self.operations:
            raise ValueError(
                f"{type(self.inner).__name__} has no operation {operation!r}; "
                f"choose from {', '.join(sorted(self.operations))}"
            )
        return operation

    @staticmethod
    def _error(operation: str, error: Exception | None) -> Exception:
        if error is not None:
            return error
        return StoreError(f"{operation} failed: injected by FaultyStore")

    # --- calls --------------------------------------------------------------------------------

    async def _call(
        self, operation: str, call: Callable[[], Awaitable[_T]], spelling: str | None = None
    ) -> _T:
        names = (operation,) if spelling is None else (operation, spelling)
        self.calls.update(names)
        for stall in [stall for stall in self._stalls if any(map(stall.holds, names))]:
            await stall._hold()
        for name in names:
            failure = self._failures.get(name)
            if failure is not None:
                if failure.remaining is not None:
                    failure.remaining -= 1
                    if failure.remaining == 0:
                        del self._failures[name]
                raise failure.error
        return await call()

    def _faulty(self, operation: str, method: Callable[..., Awaitable[Any]]) -> Any:
        @functools.wraps(method)
        async def faulty(*args: Any, **kwargs: Any) -> Any:
            return await self._call(operation, lambda: method(*args, **kwargs))

        return faulty

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        return await self._call(
            "try_acquire", lambda: self.inner.try_acquire(key, pending, lock_ttl, recover=recover)
        )

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        call = lambda: self.inner.finish(key, record, ttl)  # noqa: E731
        return await self._call("finish", call, FINISH_SPELLINGS.get(record.status))

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        call = lambda: self.inner.save_progress(key, record, ttl, lease)  # noqa: E731
        return await self._call("save_progress", call)

    async def release(self, key: str, owner_token: str) -> bool:
        return await self._call("release", lambda: self.inner.release(key, owner_token))

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        if ttl is None or not renews_retention(self.inner):
            return await self._call("renew", lambda: self.inner.renew(key, owner_token, lock_ttl))
        renew: Callable[..., Awaitable[bool]] = self.inner.renew
        return await self._call("renew", lambda: renew(key, owner_token, lock_ttl, ttl=ttl))

    async def get(self, key: str) -> IdempotencyRecord | None:
        return await self._call("get", lambda: self.inner.get(key))

    async def aclose(self) -> None:
        await self._call("aclose", self.inner.aclose)


__all__ = ["FaultyStore", "Stall"]
