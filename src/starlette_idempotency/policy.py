"""Per-route idempotency policy and the ``@idempotent`` decorator.

The decorator records which options a route overrides; the middleware merges them over its own
defaults once per route. In the documented order (``@app.post(...)`` above ``@idempotent(...)``)
the decorator also wraps the endpoint so the middleware learns when the endpoint itself began,
which tells a FastAPI validation 422 or an auth dependency's 401 (nothing ran) from a handler's
own 4xx (a business outcome). The wrapper keeps the endpoint's signature, so FastAPI's
introspection and OpenAPI see the original function.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar, cast

from starlette.requests import HTTPConnection

from starlette_idempotency.errors import ConfigurationError

StoreErrorPolicy = Literal["fail_closed", "fail_open"]
FingerprintMode = Literal["raw", "validated"]
FingerprintChangePolicy = Literal["replay", "reject"]
InProgressPolicy = Literal["conflict", "wait"]
ReplayPolicy = Literal["response", "reject"]
RecoveryPolicy = Literal["handler", "hold"]

# Never part of a fingerprint: credentials rotate, and the key is what the fingerprint guards.
_FORBIDDEN_FINGERPRINT_HEADERS = frozenset({"authorization", "cookie", "idempotency-key"})

_F = TypeVar("_F", bound=Callable[..., Any])

POLICY_ATTRIBUTE = "__idempotency_overrides__"
MARKS_START_ATTRIBUTE = "__idempotency_marks_start__"


@dataclass(frozen=True, slots=True)
class IdempotencyPolicy:
    """The options that govern one route (see the README for each)."""

    ttl_hours: float = 24.0
    lock_ttl_seconds: float = 30.0
    required: bool = True
    exclude_fields: tuple[str, ...] = ()
    fingerprint_headers: tuple[str, ...] = ()
    on_store_error: StoreErrorPolicy = "fail_closed"
    renew_lock: bool = True
    fingerprint: FingerprintMode = "raw"
    fingerprint_version: str = "1"
    on_fingerprint_change: FingerprintChangePolicy = "replay"
    on_in_progress: InProgressPolicy = "conflict"
    wait_timeout_seconds: float = 10.0
    replay: ReplayPolicy = "response"
    max_response_bytes: int = 1024 * 1024
    on_recovery: RecoveryPolicy = "handler"
    # Derived once, for the hot path: lower-cased names as the fingerprint matches them.
    excluded_field_names: frozenset[str] = field(init=False, repr=False, compare=False)
    fingerprint_header_names: frozenset[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.ttl_hours <= 0:
            raise ConfigurationError("ttl_hours must be positive")
        if self.lock_ttl_seconds <= 0:
            raise ConfigurationError("lock_ttl_seconds must be positive")
        if self.wait_timeout_seconds <= 0:
            raise ConfigurationError("wait_timeout_seconds must be positive")
        if self.max_response_bytes < 0:
            raise ConfigurationError("max_response_bytes must not be negative")
        for name, allowed in (
            ("on_store_error", ("fail_closed", "fail_open")),
            ("fingerprint", ("raw", "validated")),
            ("on_fingerprint_change", ("replay", "reject")),
            ("on_in_progress", ("conflict", "wait")),
            ("replay", ("response", "reject")),
            ("on_recovery", ("handler", "hold")),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigurationError(f"{name} must be one of {', '.join(map(repr, allowed))}")
        object.__setattr__(self, "fingerprint_version", str(self.fingerprint_version))
        for name in ("exclude_fields", "fingerprint_headers"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigurationError(f"{name} must be a sequence of names, not a string")
            object.__setattr__(self, name, tuple(value))
        forbidden = {h.lower() for h in self.fingerprint_headers} & _FORBIDDEN_FINGERPRINT_HEADERS
        if forbidden:
            raise ConfigurationError(
                f"fingerprint_headers must not include {', '.join(sorted(forbidden))}"
            )
        object.__setattr__(
            self, "excluded_field_names", frozenset(name.lower() for name in self.exclude_fields)
        )
        object.__setattr__(
            self,
            "fingerprint_header_names",
            frozenset(name.lower().encode("latin-1") for name in self.fingerprint_headers),
        )

    @property
    def ttl_seconds(self) -> float:
        return self.ttl_hours * 3600.0

    def merged(self, overrides: dict[str, Any]) -> IdempotencyPolicy:
        """This policy with a route's overrides applied."""
        return replace(self, **overrides) if overrides else self


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


def _note_endpoint_started() -> None:
    marks = current_marks.get()
    if marks is not None:
        if marks.must_not_start:
            raise UnprotectedEndpointError(UnprotectedEndpointError.__doc__)
        marks.endpoint_started = True


def _wrap_marking_start(func: _F) -> _F:
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            _note_endpoint_started()
            return await func(*args, **kwargs)

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            _note_endpoint_started()
            return func(*args, **kwargs)

        wrapper = sync_wrapper
    setattr(wrapper, MARKS_START_ATTRIBUTE, True)
    return cast(_F, wrapper)


def idempotent(
    *,
    ttl_hours: float | None = None,
    lock_ttl_seconds: float | None = None,
    required: bool | None = None,
    exclude_fields: Sequence[str] | None = None,
    fingerprint_headers: Sequence[str] | None = None,
    on_store_error: StoreErrorPolicy | None = None,
    renew_lock: bool | None = None,
    fingerprint: FingerprintMode | None = None,
    fingerprint_version: str | None = None,
    on_fingerprint_change: FingerprintChangePolicy | None = None,
    on_in_progress: InProgressPolicy | None = None,
    wait_timeout_seconds: float | None = None,
    replay: ReplayPolicy | None = None,
    max_response_bytes: int | None = None,
    on_recovery: RecoveryPolicy | None = None,
) -> Callable[[_F], _F]:
    """Make a POST/PATCH endpoint idempotent under :class:`IdempotencyMiddleware`.

    Every option left out (``None``) takes the middleware's value; the README describes each.
    Put it below ``@app.post(...)``::

        @app.post("/payments")
        @idempotent(ttl_hours=48, lock_ttl_seconds=60)
        async def pay(body: Payment) -> Receipt: ...
    """
    given = {name: value for name, value in locals().items() if value is not None}
    # Validate now, at import time, and keep the normalised values.
    validated = IdempotencyPolicy().merged(given)
    overrides = {name: getattr(validated, name) for name in given}

    def decorate(func: _F) -> _F:
        # Set on the function itself too: in the reverse order the router already holds it.
        setattr(func, POLICY_ATTRIBUTE, overrides)
        wrapper = _wrap_marking_start(func)
        setattr(wrapper, POLICY_ATTRIBUTE, overrides)
        return wrapper

    return decorate


def mark_retryable(request: HTTPConnection) -> None:
    """Tell the middleware this request's failure had no side effect: release its key.

    Call it from a handler that refuses a request before writing anything (a duplicate e-mail,
    say), so the client may fix the problem and retry with the same key. Outside a guarded
    request it does nothing.
    """
    marks = request.scope.get(MARKS_SCOPE_KEY) or current_marks.get()
    if marks is not None:
        marks.retryable = True
