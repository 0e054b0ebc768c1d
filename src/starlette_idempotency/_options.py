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
import logging
import math
import numbers
import re
import typing
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, TypeGuard

from starlette_idempotency._kept_response import Redactor, StoredParts
from starlette_idempotency._keys import (
    KeyFormat,
    KeyFunction,
    KeySource,
    predicate_answer,
    refuse_async_predicate,
)
from starlette_idempotency.errors import ConfigurationError

logger = logging.getLogger(__name__)

StoreErrorPolicy = Literal["fail_closed", "fail_open"]
FingerprintMode = Literal["raw", "validated"]
FingerprintChangePolicy = Literal["replay", "reject"]
InProgressPolicy = Literal["conflict", "wait"]
ReplayPolicy = Literal["response", "reject"]
RecoveryPolicy = Literal["handler", "hold"]

# Never part of a fingerprint: credentials rotate, and the key is what the fingerprint guards.
_FORBIDDEN_FINGERPRINT_HEADERS = frozenset({"authorization", "cookie", "idempotency-key"})

KeyFormatOption = str | re.Pattern[str] | Callable[[str], bool]
"""``key_format=``: ``"uuid"``, a regular expression the whole key must match, or a predicate."""
ReleaseStatuses = Collection[int] | Callable[[int], bool]
"""``release_statuses=``: the statuses that free the key, or a predicate on the status."""

# Server errors, and the statuses that say "try again" rather than "this is the outcome":
# released by default (a set's own lookup, the cheapest call on the request path).
_released_by_default = frozenset({408, 429, *range(500, 1000)}).__contains__


def _release_check(statuses: ReleaseStatuses | None) -> Callable[[int], bool]:
    """What ``release_statuses`` decides for a status: ``True`` frees the key."""
    if statuses is None:
        return _released_by_default
    if callable(statuses):
        decide = statuses

        def released(status: int) -> bool:
            try:
                return predicate_answer(decide(status), "release_statuses")
            except Exception:
                logger.exception(
                    "release_statuses %r raised for status %d: the default decides instead "
                    "(5xx, 408 and 429 free the key)",
                    decide,
                    status,
                )
                return _released_by_default(status)

        return released
    return typing.cast(frozenset[int], statuses).__contains__


def _release_statuses(statuses: object) -> ReleaseStatuses | None:
    """``statuses`` checked, a collection of them as a frozenset."""
    if statuses is None:
        return None
    if callable(statuses):
        refuse_async_predicate(statuses, "release_statuses", "status -> bool")
        return statuses
    if isinstance(statuses, str | bytes) or not isinstance(statuses, Iterable):
        raise ConfigurationError(
            "release_statuses must be a collection of HTTP statuses such as {500, 503}, or a "
            f"function status -> bool, not {statuses!r}"
        )
    checked = frozenset(statuses)
    wrong = [s for s in checked if not isinstance(s, int) or isinstance(s, bool)]
    wrong += [s for s in checked if isinstance(s, int) and not 100 <= s <= 599]
    if wrong:
        raise ConfigurationError(
            f"release_statuses must hold HTTP statuses (whole numbers from 100 to 599), not "
            f"{', '.join(map(repr, wrong))}"
        )
    return checked


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
    key_from: KeySource | KeyFunction | None = None
    key_format: KeyFormatOption | None = None
    release_statuses: ReleaseStatuses | None = None
    # Derived once, for the hot path: lower-cased names as the fingerprint matches them.
    excluded_field_names: frozenset[str] = field(init=False, repr=False, compare=False)
    fingerprint_header_names: frozenset[bytes] = field(init=False, repr=False, compare=False)
    #: What of this route's responses is stored (the three options above, checked).
    stored_parts: StoredParts = field(init=False, repr=False, compare=False)
    #: ``ttl_hours`` in seconds.
    ttl_seconds: float = field(init=False, repr=False, compare=False)
    #: ``key_from`` as a source; ``None`` for the middleware's ``header_name``.
    key_source: KeySource | None = field(init=False, repr=False, compare=False)
    #: ``key_format`` checked; ``None`` when every key is accepted.
    key_check: KeyFormat | None = field(init=False, repr=False, compare=False)
    #: ``release_statuses`` as a decision: whether a response of this status frees the key.
    releases: Callable[[int], bool] = field(init=False, repr=False, compare=False)
    #: ``on_recovery`` as the store's ``recover``: whether an acquire takes over a record whose
    #: lease ran out (``"handler"``), or leaves it to an operator (``"hold"``).
    recover: bool = field(init=False, repr=False, compare=False)

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
        source = None if self.key_from is None else KeySource.of(self.key_from)
        object.__setattr__(self, "key_source", source)
        check = None if self.key_format is None else KeyFormat.of(self.key_format)
        object.__setattr__(self, "key_check", check)
        statuses = _release_statuses(self.release_statuses)
        object.__setattr__(self, "release_statuses", statuses)
        object.__setattr__(self, "releases", _release_check(statuses))
        object.__setattr__(self, "recover", self.on_recovery != "hold")

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
    key_from: KeySource | KeyFunction | None
    key_format: KeyFormatOption | None
    release_statuses: ReleaseStatuses | None
