"""Who owns a request's keys: ``key_scope``'s answer, or the authenticated user."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection

from starlette_idempotency._types import Scope

logger = logging.getLogger(__name__)

KeyScope = Callable[[HTTPConnection], "str | Awaitable[str | None] | None"]
"""Returns the owner of a request's keys (a user or tenant id); sync or async."""

_UNSCOPED_WARNING = (
    "Idempotency keys are not scoped to a user: no key_scope was given and no "
    "authentication middleware set scope['user'], so two clients sending the same key "
    "share one stored response. Pass key_scope= or add the authentication middleware "
    "outside IdempotencyMiddleware."
)
_ANONYMOUS_WARNING = (
    "Idempotency keys of unauthenticated requests are not scoped to anyone: scope['user'] is "
    "not authenticated, so two anonymous clients sending the same key share one stored "
    "response. Require authentication on guarded routes, or pass key_scope= to scope their "
    "keys (by API key, session or client id)."
)


class KeyScopeResolver:
    """Names the owner of a request's keys; warns once when requests share one owner."""

    __slots__ = ("_key_scope", "_warned")

    def __init__(self, key_scope: KeyScope | None) -> None:
        self._key_scope = key_scope
        self._warned: set[str] = set()

    async def __call__(self, scope: Scope) -> str:
        if self._key_scope is not None:
            try:
                value = self._key_scope(HTTPConnection(scope))
                if inspect.isawaitable(value):
                    value = await value
            except HTTPException:
                raise  # the app's own answer (a 401 for a bad token, say): the request sends it
            except Exception:
                logger.exception(
                    "key_scope %r raised on %s %s, so the request fails with a 500; to refuse "
                    "a request (a missing or expired token), raise an HTTPException from it",
                    self._key_scope,
                    scope.get("method"),
                    scope.get("path"),
                )
                raise
            return "" if value is None else str(value)
        user = scope.get("user")
        if user is None:
            self._warn_once(_UNSCOPED_WARNING)
            return ""
        if not getattr(user, "is_authenticated", False):
            self._warn_once(_ANONYMOUS_WARNING)
            return ""
        try:
            identity = user.identity
        except (AttributeError, NotImplementedError):
            identity = None
        return str(identity or getattr(user, "display_name", "") or "")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)
