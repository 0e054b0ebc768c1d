"""What the endpoint side tells the middleware about one request.

The middleware puts a :class:`RequestMarks` in the scope and in a context variable; the
endpoint wrapper ``@idempotent`` installs reports that the endpoint began, and
:func:`mark_retryable` that a failure had no side effect.
"""

from __future__ import annotations

import contextvars

from starlette.requests import HTTPConnection

MARKS_SCOPE_KEY = "starlette_idempotency.marks"


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


def note_endpoint_started() -> None:
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
