"""What the middleware and the endpoint side tell each other about one request.

The middleware marks every HTTP request it sees with what it decided (:data:`GUARD_SCOPE_KEY`):
the handler it guards the request for, :data:`METHOD_NOT_GUARDED`, or ``None`` when it found no
guarded route. The ``@idempotent`` wrapper reads that mark when a router calls it and refuses to
run a request no guard saw, or one a guard took for another endpoint (:func:`enter_endpoint`).

For a request that owns its key the middleware also puts a :class:`RequestMarks` in the scope
and in a context variable: the wrapper reports that the endpoint began, and
:func:`mark_retryable` that a failure had no side effect.
"""

from __future__ import annotations

import contextvars
from typing import Any, Final

from starlette.requests import HTTPConnection

from starlette_idempotency.errors import UnguardedRequestError

MARKS_SCOPE_KEY = "starlette_idempotency.marks"
#: Where the middleware records, for every HTTP request it passes on, what it guards it as.
GUARD_SCOPE_KEY = "starlette_idempotency.guard"
#: The guard's mark for a request whose method it does not guard (a GET, say).
METHOD_NOT_GUARDED: Final = "method not guarded"


class RequestMarks:
    """Facts the endpoint side reports to the middleware for one request."""

    __slots__ = ("endpoint_started", "must_not_start", "retryable")

    def __init__(self) -> None:
        self.endpoint_started = False
        self.retryable = False
        self.must_not_start = False


# Holds a mutable object, so a sync endpoint running in a worker thread (which gets a copy of
# the context) still reports to the middleware's request.
current_marks: contextvars.ContextVar[RequestMarks | None] = contextvars.ContextVar(
    "starlette_idempotency_marks", default=None
)


class UnprotectedEndpointError(RuntimeError):
    """The endpoint began on a body that ``fingerprint="validated"`` found invalid.

    The app's validation accepted what its own body model rejects, so no key was acquired;
    running the endpoint would be unprotected.
    """


#: No guard saw the request (no mark in its scope).
_UNSEEN: Final = object()


def _name(handler: Any) -> str:
    return f"{getattr(handler, '__module__', '?')}.{getattr(handler, '__qualname__', handler)}"


def _refusal(handler: Any, scope: Any, mark: Any) -> UnguardedRequestError:
    route = f"{scope.get('method')} {scope.get('path')}"
    if mark is _UNSEEN:
        cause = (
            "no IdempotencyMiddleware saw this request. Add it to the app that serves the "
            "route (app.add_middleware(IdempotencyMiddleware, store=...)), or to an app that "
            "mounts it; an app under test needs it too"
        )
    elif mark is None:
        cause = (
            "IdempotencyMiddleware saw the request but found no guarded route for it, so "
            "something between them changed where it goes (a middleware inside "
            "IdempotencyMiddleware that rewrites the path, or an app it cannot see into). Add "
            "IdempotencyMiddleware inside that middleware (app.add_middleware it first), or "
            "mount the app so that its routes are reachable through .routes"
        )
    else:
        cause = (
            f"IdempotencyMiddleware guarded the request as one to {_name(mark)}, so its key "
            "and policy are another endpoint's (a middleware inside IdempotencyMiddleware "
            "rewrote the path, or the route sits in an app it cannot see into)"
        )
    return UnguardedRequestError(f"@idempotent {_name(handler)} was not run for {route}: {cause}")


def enter_endpoint(handler: object, connection: HTTPConnection | None) -> None:
    """Called by the ``@idempotent`` wrapper ``handler`` as it starts.

    ``connection`` is the request when a router called the endpoint (``None`` for a direct
    call, as a unit test makes): refused unless a guard saw it and guarded it as a request to
    this very handler, or passed it on because its method is not guarded.
    """
    if connection is not None:
        scope = connection.scope
        if scope.get("type") == "http" and "endpoint" in scope:  # dispatched by a router
            mark = scope.get(GUARD_SCOPE_KEY, _UNSEEN)
            if mark is not handler and mark is not METHOD_NOT_GUARDED:
                raise _refusal(handler, scope, mark)
    marks = current_marks.get()
    if marks is not None:
        if marks.must_not_start:
            raise UnprotectedEndpointError(UnprotectedEndpointError.__doc__)
        marks.endpoint_started = True


def mark_retryable(request: HTTPConnection) -> None:
    """Tell the middleware this request's failure had no side effect: release its key.

    Call it from a handler that refuses a request before writing anything (a duplicate e-mail,
    say), so the client may fix the problem and retry with the same key. Outside a guarded
    request it does nothing.
    """
    marks = request.scope.get(MARKS_SCOPE_KEY) or current_marks.get()
    if marks is not None:
        marks.retryable = True
