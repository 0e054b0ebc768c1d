"""What a handler can learn and record about its own idempotent request.

``checkpoint(request, name, data)`` saves a recovery point on the request's record while the
handler runs; if the process dies after it, the retry that takes the key over sees it through
``idempotency_context(request).recovered_from`` and can reconcile (ask the payment provider
what happened) instead of acting again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import HTTPConnection

from starlette_idempotency._record import Checkpoint
from starlette_idempotency.errors import IdempotencyError

CONTEXT_SCOPE_KEY = "starlette_idempotency._context"

SaveCheckpoint = Callable[[str, Any], Awaitable[None]]


class IdempotencyContext:
    """The idempotency side of one guarded request that owns its key."""

    def __init__(self, key: str, inherited: tuple[Checkpoint, ...], save: SaveCheckpoint) -> None:
        self.key = key
        #: Recovery points left by an earlier attempt that died, oldest first.
        self.inherited = inherited
        self._save = save

    @property
    def recovered_from(self) -> str | None:
        """The last recovery point of the attempt this request took over, if any."""
        return self.inherited[-1].name if self.inherited else None

    @property
    def recovery_data(self) -> Any:
        """The data saved with :attr:`recovered_from`."""
        return self.inherited[-1].data if self.inherited else None

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """Save a recovery point (JSON-serialisable ``data``) before the request goes on.

        Raises :class:`~starlette_idempotency.errors.LockLostError` when another request has
        taken the key over, and ``StoreError`` when it could not be saved: either way, do not
        go on with the side effect.
        """
        await self._save(name, data)


def idempotency_context(request: HTTPConnection) -> IdempotencyContext:
    """The context of a guarded request that owns its idempotency key."""
    context = request.scope.get(CONTEXT_SCOPE_KEY)
    if context is None:
        raise IdempotencyError(
            "no idempotency context: the request is not guarded by IdempotencyMiddleware "
            "or did not acquire its key"
        )
    assert isinstance(context, IdempotencyContext)
    return context


async def checkpoint(request: HTTPConnection, name: str, data: Any = None) -> None:
    """Save a recovery point on the request's idempotency record (see the module docs)."""
    await idempotency_context(request).checkpoint(name, data)
