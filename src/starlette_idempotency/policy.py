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
import difflib
import functools
import inspect
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast, overload

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


def unknown_option_error(unknown: Iterable[str], known: Iterable[str], where: str) -> Exception:
    """A :class:`ConfigurationError` naming each unknown option, with the closest known name."""
    known = sorted(known)
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigurationError(
        f"unknown option{'s' if len(parts) > 1 else ''} for {where}: {', '.join(parts)}; "
        f"the options are {', '.join(known)}"
    )


_NUMBER_OPTIONS = {
    "ttl_hours": "a positive number of hours",
    "lock_ttl_seconds": "a positive number of seconds",
    "wait_timeout_seconds": "a positive number of seconds",
}
_CHOICES = {
    "on_store_error": ("fail_closed", "fail_open"),
    "fingerprint": ("raw", "validated"),
    "on_fingerprint_change": ("replay", "reject"),
    "on_in_progress": ("conflict", "wait"),
    "replay": ("response", "reject"),
    "on_recovery": ("handler", "hold"),
}


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class IdempotencyPolicy:
    """The options that govern one route (the documentation's options reference has each)."""

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
        for name, accepted in _NUMBER_OPTIONS.items():
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise ConfigurationError(f"{name} must be {accepted}, not {value!r}")
        if self.lock_ttl_seconds > self.ttl_seconds:
            raise ConfigurationError(
                f"lock_ttl_seconds ({self.lock_ttl_seconds:g} s) must not exceed ttl_hours "
                f"({self.ttl_hours:g} h = {self.ttl_seconds:g} s): a record must outlive its lock"
            )
        if not isinstance(self.max_response_bytes, int) or isinstance(
            self.max_response_bytes, bool
        ):
            raise ConfigurationError(
                f"max_response_bytes must be a whole number of bytes, not "
                f"{self.max_response_bytes!r}"
            )
        if self.max_response_bytes < 0:
            raise ConfigurationError("max_response_bytes must not be negative")
        for name in ("required", "renew_lock"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(
                    f"{name} must be True or False, not {getattr(self, name)!r}"
                )
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigurationError(
                    f"{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"not {getattr(self, name)!r}"
                )
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


#: The names of the route options (the fields of :class:`IdempotencyPolicy` one can set).
ROUTE_OPTIONS = frozenset(f.name for f in fields(IdempotencyPolicy) if f.init)


class RouteOptions(TypedDict, total=False):
    """The options ``@idempotent`` takes; each left out takes the middleware's value."""

    ttl_hours: float
    lock_ttl_seconds: float
    required: bool
    exclude_fields: Sequence[str]
    fingerprint_headers: Sequence[str]
    on_store_error: StoreErrorPolicy
    renew_lock: bool
    fingerprint: FingerprintMode
    fingerprint_version: str
    on_fingerprint_change: FingerprintChangePolicy
    on_in_progress: InProgressPolicy
    wait_timeout_seconds: float
    replay: ReplayPolicy
    max_response_bytes: int
    on_recovery: RecoveryPolicy


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


@overload
def idempotent(func: _F, /) -> _F: ...


@overload
def idempotent(func: None = None, /, **options: Unpack[RouteOptions]) -> Callable[[_F], _F]: ...


def idempotent(func: Any = None, /, **options: Any) -> Any:
    """Make a POST/PATCH endpoint idempotent under :class:`IdempotencyMiddleware`.

    Every option left out takes the middleware's value; the documentation's options reference
    describes each. Put it below ``@app.post(...)``; bare ``@idempotent`` takes every option
    from the middleware::

        @app.post("/payments")
        @idempotent(ttl_hours=48, lock_ttl_seconds=60)
        async def pay(body: Payment) -> Receipt: ...
    """
    if func is not None and not callable(func):
        raise ConfigurationError(
            f"@idempotent takes its options by name, e.g. @idempotent(ttl_hours=48), not {func!r}"
        )
    unknown = options.keys() - ROUTE_OPTIONS
    if unknown:
        raise unknown_option_error(unknown, ROUTE_OPTIONS, "@idempotent")
    given = {name: value for name, value in options.items() if value is not None}
    # Validate now, at import time, and keep the normalised values. The lock may outlive the
    # default retention here: the middleware's ttl_hours is what it will be merged with.
    validated = IdempotencyPolicy(ttl_hours=float("inf")).merged(given)
    overrides = {name: getattr(validated, name) for name in given}

    def decorate(func: _F) -> _F:
        # Set on the function itself too: in the reverse order the router already holds it.
        setattr(func, POLICY_ATTRIBUTE, overrides)
        wrapper = _wrap_marking_start(func)
        setattr(wrapper, POLICY_ATTRIBUTE, overrides)
        return wrapper

    return decorate if func is None else decorate(func)


def misplaced_decorator_error(template: str) -> ConfigurationError:
    """``@idempotent`` above the route decorator: the router holds the undecorated endpoint,
    so the middleware could not tell a validation 422 from the handler's own."""
    return ConfigurationError(
        f"@idempotent is above the route decorator on {template}; put it below, so that it "
        f"wraps the endpoint the router calls:\n\n"
        f'    @app.post("{template}")\n    @idempotent(...)\n    async def endpoint(...): ...'
    )


def mark_retryable(request: HTTPConnection) -> None:
    """Tell the middleware this request's failure had no side effect: release its key.

    Call it from a handler that refuses a request before writing anything (a duplicate e-mail,
    say), so the client may fix the problem and retry with the same key. Outside a guarded
    request it does nothing.
    """
    marks = request.scope.get(MARKS_SCOPE_KEY) or current_marks.get()
    if marks is not None:
        marks.retryable = True
