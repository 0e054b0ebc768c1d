"""The route options: declared once, with their types and defaults, in
:class:`IdempotencyPolicy`; their validation follows from the declared types.

``@idempotent`` and ``IdempotencyMiddleware`` take them as keywords typed by
:class:`RouteOptions`, so that type checkers and IDEs know each name. A type checker cannot
derive a keyword signature from a dataclass, so that is the one other place the names stand (no
defaults there); ``tests/test_architecture.py`` holds the two to the same names and types. The
middleware's values are the defaults a route's own override.
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, TypeGuard

from starlette_idempotency._protection import Redactor, StoredParts
from starlette_idempotency.errors import ConfigurationError

StoreErrorPolicy = Literal["fail_closed", "fail_open"]
FingerprintMode = Literal["raw", "validated"]
FingerprintChangePolicy = Literal["replay", "reject"]
InProgressPolicy = Literal["conflict", "wait"]
ReplayPolicy = Literal["response", "reject"]
RecoveryPolicy = Literal["handler", "hold"]

# Never part of a fingerprint: credentials rotate, and the key is what the fingerprint guards.
_FORBIDDEN_FINGERPRINT_HEADERS = frozenset({"authorization", "cookie", "idempotency-key"})


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


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_option(name: str, declared: Any, value: object) -> None:
    """Refuse ``value`` for the option ``name`` unless it fits its declared type: one of a
    ``Literal``'s values, ``True`` or ``False``, a positive finite number (of the unit its name
    ends in: ``_hours``, ``_seconds``), a whole number that is not negative (of bytes, for a
    name ending in ``_bytes``). Other types are not checked here."""
    if typing.get_origin(declared) is Literal:
        allowed = typing.get_args(declared)
        if value not in allowed:
            raise ConfigurationError(
                f"{name} must be one of {', '.join(map(repr, allowed))}, not {value!r}"
            )
    elif declared is bool:
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    elif declared is float:
        if not _is_number(value) or not 0 < value < math.inf:
            unit = name.rsplit("_", 1)[-1]
            raise ConfigurationError(f"{name} must be a positive number of {unit}, not {value!r}")
    elif declared is int:
        unit = " of bytes" if name.endswith("_bytes") else ""
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigurationError(f"{name} must be a whole number{unit}, not {value!r}")
        if value < 0:
            raise ConfigurationError(f"{name} must not be negative, not {value!r}")


@functools.cache
def _declared_types() -> dict[str, Any]:
    """Each route option's declared type, in the order the policy declares them."""
    hints = typing.get_type_hints(IdempotencyPolicy)
    return {option.name: hints[option.name] for option in fields(IdempotencyPolicy) if option.init}


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
    max_processing_seconds: float = 300.0
    fingerprint: FingerprintMode = "raw"
    fingerprint_version: str = "1"
    on_fingerprint_change: FingerprintChangePolicy = "replay"
    on_in_progress: InProgressPolicy = "conflict"
    wait_timeout_seconds: float = 10.0
    replay: ReplayPolicy = "response"
    max_response_bytes: int = 1024 * 1024
    on_recovery: RecoveryPolicy = "handler"
    stored_headers: tuple[str, ...] | None = None
    never_stored_headers: tuple[str, ...] = ()
    redact_response: Redactor | None = None
    # Derived once, for the hot path: lower-cased names as the fingerprint matches them.
    excluded_field_names: frozenset[str] = field(init=False, repr=False, compare=False)
    fingerprint_header_names: frozenset[bytes] = field(init=False, repr=False, compare=False)
    #: What of this route's responses is stored (the three options above, checked).
    stored_parts: StoredParts = field(init=False, repr=False, compare=False)
    #: ``ttl_hours`` in seconds.
    ttl_seconds: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, declared in _declared_types().items():
            check_option(name, declared, getattr(self, name))
        object.__setattr__(self, "ttl_seconds", self.ttl_hours * 3600.0)
        if self.lock_ttl_seconds > self.ttl_seconds:
            raise ConfigurationError(
                f"lock_ttl_seconds ({self.lock_ttl_seconds:g} s) must not exceed ttl_hours "
                f"({self.ttl_hours:g} h = {self.ttl_seconds:g} s): a record must outlive its lock"
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
        parts = StoredParts(self.stored_headers, self.never_stored_headers, self.redact_response)
        object.__setattr__(self, "stored_headers", parts.stored_headers)
        object.__setattr__(self, "never_stored_headers", parts.never_stored_headers)
        object.__setattr__(self, "stored_parts", parts)
        object.__setattr__(
            self, "excluded_field_names", frozenset(name.lower() for name in self.exclude_fields)
        )
        object.__setattr__(
            self,
            "fingerprint_header_names",
            frozenset(name.lower().encode("latin-1") for name in self.fingerprint_headers),
        )

    def merged(self, overrides: Mapping[str, Any]) -> IdempotencyPolicy:
        """This policy with a route's overrides applied."""
        return replace(self, **overrides) if overrides else self


#: The names of the route options (the fields of :class:`IdempotencyPolicy` one can set).
ROUTE_OPTIONS = frozenset(f.name for f in fields(IdempotencyPolicy) if f.init)


class RouteOptions(TypedDict, total=False):
    """The route options as keywords (``@idempotent`` and ``IdempotencyMiddleware`` take them):
    names and types only; :class:`IdempotencyPolicy` holds the defaults."""

    ttl_hours: float
    lock_ttl_seconds: float
    required: bool
    exclude_fields: Sequence[str]
    fingerprint_headers: Sequence[str]
    on_store_error: StoreErrorPolicy
    renew_lock: bool
    max_processing_seconds: float
    fingerprint: FingerprintMode
    fingerprint_version: str
    on_fingerprint_change: FingerprintChangePolicy
    on_in_progress: InProgressPolicy
    wait_timeout_seconds: float
    replay: ReplayPolicy
    max_response_bytes: int
    on_recovery: RecoveryPolicy
    stored_headers: Sequence[str] | None
    never_stored_headers: Sequence[str]
    redact_response: Redactor | None
