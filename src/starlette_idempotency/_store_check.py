"""The store around the app's lifespan: checked when the app starts (and by ``doctor`` from a
shell), the app's operations claimed in it while it runs, closed when it stops.

A store that implements :class:`~starlette_idempotency.stores.base.CheckableStore` is reached
once at startup: unreachable is logged as one error naming the store and its address, and what
weakens the guarantees (a Redis that may evict or forget records) as warnings. With
``check_store="fail"`` an error refuses the startup instead; a store that cannot work as it is
configured (a ``ConfigurationError``) refuses it whatever the policy. For a store that opens its
connections on first use, the check is what opens them, in the server's event loop.

A store that opened its connections itself
(:class:`~starlette_idempotency.stores.base.ConnectionOwningStore`) is closed when the
lifespan ends, before the server hears of it; a client or pool the app passed in stays open.

The operations the app guards are claimed last, once nothing else can refuse the startup, and
released when the lifespan ends (see :mod:`~starlette_idempotency._claims`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Literal

from starlette_idempotency._claims import OperationClaims, ServedOperation
from starlette_idempotency._types import ASGIApp, Message, Receive, Scope, Send
from starlette_idempotency.errors import ConfigurationError, IdempotencyError, StoreError
from starlette_idempotency.stores.base import (
    CheckableStore,
    ConnectionOwningStore,
    IdempotencyStore,
    OperationClaimingStore,
    StoreFinding,
)

logger = logging.getLogger(__name__)

StoreCheckPolicy = Literal["warn", "fail", "off"]

#: How long the whole check may take before the store counts as unreachable.
CHECK_TIMEOUT_SECONDS = 5.0
#: How long closing the store's own connections may take when the app stops.
CLOSE_TIMEOUT_SECONDS = 5.0
#: The lifespan's last words to the server: after them the app serves nothing more.
_LIFESPAN_ENDS = frozenset(
    {"lifespan.startup.failed", "lifespan.shutdown.complete", "lifespan.shutdown.failed"}
)


async def check_store(
    store: object,
    timeout: float | None = None,  # noqa: ASYNC109 - no answer is a finding, not an exception
) -> list[StoreFinding]:
    """What ``store`` reports about itself; ``[]`` for a store that cannot check itself.

    Raises the :class:`ConfigurationError` of a store that cannot work as it is configured;
    any other failure of the check, or no answer within ``timeout`` seconds
    (:data:`CHECK_TIMEOUT_SECONDS` by default), is an ``error`` finding."""
    if not isinstance(store, CheckableStore):
        return []
    if timeout is None:
        timeout = CHECK_TIMEOUT_SECONDS
    try:
        async with asyncio.timeout(timeout):
            return await store.check()
    except TimeoutError:
        message = f"no answer within {timeout:g}s"
    except ConfigurationError:
        raise
    except Exception as exc:  # a store's check must not stop the app on its own
        message = f"its check failed: {exc!r}"
    return [StoreFinding("error", f"{store.describe()} is unreachable: {message}")]


async def close_own_connections(store: ConnectionOwningStore) -> None:
    """Close ``store``; a failure is logged, not raised (the app stops either way)."""
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_SECONDS):
            await store.aclose()
    except Exception as exc:  # TimeoutError included: asyncpg then terminates its connections
        logger.warning("idempotency store: closing its connections failed: %r", exc)


def log_findings(findings: list[StoreFinding]) -> None:
    for finding in findings:
        if finding.level == "error":
            logger.error("idempotency store check: %s", finding.message)
        else:
            logger.warning("idempotency store check: %s", finding.message)


async def refuse_startup(refusal: IdempotencyError, receive: Receive, send: Send) -> None:
    """Answer the lifespan's startup with a failure, log why once, and raise it."""
    message = await receive()
    if message["type"] == "lifespan.startup":
        await send(startup_failed(refusal))
    raise refusal


#: The message a refused startup goes out with. Servers log it (uvicorn at ERROR): the
#: refusal itself is logged once, through the library's logger, and this only points there.
REFUSED_STARTUP = "IdempotencyMiddleware refused the startup: see the error logged above"


def startup_failed(refusal: IdempotencyError) -> Message:
    """Log ``refusal`` (once) and make the ``lifespan.startup.failed`` message for it."""
    logger.error("idempotency: the app cannot start: %s", refusal)
    return {"type": "lifespan.startup.failed", "message": REFUSED_STARTUP}


class StartupCheck:
    """Runs the checks when the app reports ``lifespan.startup.complete``: after the app's own
    startup, which may be where it hands the store its pool, and once its routes are all in
    place. Closes the store's own connections when the lifespan ends.

    ``check_routes`` raises :class:`ConfigurationError` for routes that would not work as
    written; that refuses the startup whatever ``policy`` says about the store. Else it returns
    the operations to claim, each store call of which takes at most ``timeout`` seconds.
    """

    def __init__(
        self,
        store: IdempotencyStore,
        policy: StoreCheckPolicy,
        check_routes: Callable[[Scope], Sequence[ServedOperation]] = lambda scope: (),
        *,
        timeout: float = CHECK_TIMEOUT_SECONDS,
    ) -> None:
        self._store = store
        self._timeout = timeout
        self._claims: OperationClaims | None = None
        #: The store, when it opened its connections itself: closed when the app stops.
        self._own = (
            store if isinstance(store, ConnectionOwningStore) and store.owns_connections else None
        )
        self.policy = policy
        self._check_routes = check_routes

    async def run(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app's lifespan, checking before its ``startup.complete`` goes out.

        A refused startup goes out as ``lifespan.startup.failed``; then the app is told to shut
        down (closing what its startup opened), and the refusal is raised, as Starlette raises
        a failed startup: a server exits, and a ``TestClient`` raises it instead of waiting.

        The store's own connections are closed before the lifespan's last message goes out
        (``shutdown.complete``, or a failed startup or shutdown): the app's shutdown has run by
        then, and a server ends the event loop, cancelling what still runs, once it hears it.
        A new ``lifespan.startup`` lets them open again (an app started again in the same
        event loop, as test runners do).
        """
        refusal: IdempotencyError | None = None

        async def send_after_check(message: Message) -> None:
            nonlocal refusal
            if refusal is not None:
                return  # the shutdown we asked for: the server did not ask for it
            if message["type"] == "lifespan.startup.complete":
                try:
                    await self._check(scope)
                except IdempotencyError as exc:
                    refusal = exc
                    message = startup_failed(exc)
            if message["type"] in _LIFESPAN_ENDS:
                await self._release_claims()
                if self._own is not None:
                    await close_own_connections(self._own)
            await send(message)

        async def receive_after_refusal() -> Message:
            if refusal is not None:
                return {"type": "lifespan.shutdown"}
            message = await receive()
            if message["type"] == "lifespan.startup" and self._own is not None:
                self._own.reopen()  # closed when the app last stopped, in this event loop
            elif message["type"] == "lifespan.shutdown":
                # The server serves no more requests: released before the app's own shutdown,
                # which may close the store's pool.
                await self._release_claims()
            return message

        await app(scope, receive_after_refusal, send_after_check)
        if refusal is not None:
            raise refusal

    def route_problems(self, scope: Scope) -> ConfigurationError | None:
        """Why the routes would not work as written, if they would not: at startup, or at the
        first request of an app whose lifespan did not run."""
        try:
            self._check_routes(scope)
        except ConfigurationError as exc:
            return exc
        return None

    async def _check(self, scope: Scope) -> None:
        """Raise what refuses the startup: a route that would not work as written, an
        unreachable store with ``check_store="fail"``, or an operation that live code of
        another name guards in the same store."""
        served = self._check_routes(scope)
        if self.policy != "off":
            findings = await check_store(self._store)
            log_findings(findings)
            errors = [finding.message for finding in findings if finding.level == "error"]
            if errors and self.policy == "fail":
                raise StoreError(
                    "idempotency store check failed (check_store='fail'): " + "; ".join(errors)
                )
        store = self._store
        if served and isinstance(store, OperationClaimingStore):
            where = store.describe() if isinstance(store, CheckableStore) else None
            claims = OperationClaims(
                store, served, timeout=self._timeout, where=where or f"the {self._store.name} store"
            )
            await claims.start()
            self._claims = claims

    async def _release_claims(self) -> None:
        claims, self._claims = self._claims, None
        if claims is not None:
            await claims.stop()
