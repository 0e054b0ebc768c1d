"""Live claims on the operations an app guards, so that two services never share one.

A record's storage key names its operation by method and route template (or
``@idempotent(operation=...)``), not by the handler that serves it: a retry across a rename or
a move of the handler, or another launch mode, finds its record and is replayed. Two different
services whose routes share a method and template on one store and key prefix would then
answer each other's requests with their own replies.

So an app claims each operation it guards when it starts, as the code that serves it (the
handler's module and qualified name), in a store that keeps claims
(:class:`~starlette_idempotency.stores.base.OperationClaimingStore`: ``RedisStore`` and
``PostgresStore``). A claim lives :data:`CLAIM_TTL_SECONDS` on the store's clock from its last
renewal; the app renews it while it runs and ends it when the server shuts it down. Claims of
one code coexist (the pods of one version, however launched); code of another name finding a
live claim refuses the startup, naming both and what to set. Once the other has stopped (at
once on a clean shutdown, else when its claim lapses) the same code starts, and its retries
are replayed.

An operation named with ``operation=`` is not claimed: the name is the identity, and two
services that give one name mean to share its records.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.stores.base import OperationClaimingStore

logger = logging.getLogger(__name__)

#: How long a claim outlives its last renewal, on the store's clock.
CLAIM_TTL_SECONDS = 15.0
#: How often a running app renews its claims.
RENEW_EVERY_SECONDS = CLAIM_TTL_SECONDS / 3


def code_name(handler: object) -> str:
    """``module:qualname`` of a handler, the same however the app was launched: ``python
    main.py`` runs it as ``__main__``, where ``uvicorn main:app`` imports ``main``."""
    module = str(getattr(handler, "__module__", "?"))
    if module == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None)
        if spec is not None and spec.name:
            module = spec.name  # python -m package.main
        elif path:
            module = Path(path).stem
    return f"{module}:{getattr(handler, '__qualname__', type(handler).__qualname__)}"


@dataclass(frozen=True, slots=True)
class ServedOperation:
    """An operation an app guards, named as its requests' storage keys name it (its method,
    and its template after the pattern of the ``Host`` above it, if any), and the code that
    serves it."""

    method: str
    template: str
    code: str

    @property
    def label(self) -> str:
        return f"{self.method} {self.template}"


def claimable(served: Iterable[ServedOperation]) -> list[ServedOperation]:
    """The operations to claim, each once: those served by one handler in the app (the routes
    below one ``Host`` pattern can serve a template with several, each for its own hosts)."""
    codes: dict[tuple[str, str], set[str]] = {}
    for operation in served:
        codes.setdefault((operation.method, operation.template), set()).add(operation.code)
    return [
        ServedOperation(method, template, next(iter(names)))
        for (method, template), names in sorted(codes.items())
        if len(names) == 1
    ]


class OperationClaims:
    """One app's claims on the operations it guards, from its startup to its shutdown."""

    def __init__(
        self,
        store: OperationClaimingStore,
        served: Sequence[ServedOperation],
        *,
        timeout: float,
        where: str,
    ) -> None:
        self._store = store
        self._served = served
        self._timeout = timeout
        self._where = where
        self._holder = secrets.token_hex(16)
        #: The operations found claimed by other code while the app ran, each logged once.
        self._reported: set[str] = set()
        self._keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Claim every operation, and keep the claims while the app runs.

        Raises :class:`ConfigurationError` when live code of another name holds one. A store
        that does not answer is logged: the app starts, and its claims are made once it does.
        """
        try:
            taken = await self._claim_all()
        except Exception as exc:  # the store is down: its check says so already
            logger.warning(
                "idempotency: could not claim the guarded operations on %s (%r); trying again "
                "every %gs",
                self._where,
                exc,
                RENEW_EVERY_SECONDS,
            )
            taken = []
        if taken:
            await self.stop()
            raise ConfigurationError("\n".join(self._collision(*pair) for pair in taken))
        self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def stop(self) -> None:
        """Stop renewing, and end the claims (best effort: they lapse anyway)."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        try:
            async with asyncio.timeout(self._timeout):
                await asyncio.gather(
                    *(
                        self._store.release_operation(operation.label, self._holder)
                        for operation in self._served
                    )
                )
        except Exception as exc:
            logger.debug("idempotency: ending the operation claims failed: %r", exc)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_SECONDS)
            try:
                taken = await self._claim_all()
            except Exception as exc:
                logger.debug("idempotency: renewing the operation claims failed: %r", exc)
                continue
            for operation, other in taken:
                if operation.label not in self._reported:
                    self._reported.add(operation.label)
                    logger.error("idempotency: %s", self._collision(operation, other))

    async def _claim_all(self) -> list[tuple[ServedOperation, str]]:
        """Claim or renew each operation; those claimed by other code, with its name."""
        async with asyncio.timeout(self._timeout):
            found = await asyncio.gather(
                *(
                    self._store.claim_operation(
                        operation.label, operation.code, self._holder, CLAIM_TTL_SECONDS
                    )
                    for operation in self._served
                )
            )
        return [
            (op, other) for op, other in zip(self._served, found, strict=True) if other is not None
        ]

    def _collision(self, operation: ServedOperation, other: str) -> str:
        return (
            f"{operation.label} is guarded on {self._where} by {operation.code} here and by "
            f"{other} in a process that is running: their records would share keys, and "
            f"each would answer the other's requests with its own replies. Two services on "
            f"one store need their own key_prefix, or their own names for what the route "
            f"does: @idempotent(operation='...'). If {other} is this handler under its former "
            f"name, in a version still running, start this one once that has stopped (its "
            f"claim lapses {CLAIM_TTL_SECONDS:g}s after it stops, at once on a clean shutdown)"
        )
