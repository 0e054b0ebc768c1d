"""When a transport retries, and how long it waits: :class:`RetryPolicy` and the
``Retry-After`` parser (the package docs hold the whole table)."""

from __future__ import annotations

import calendar
import email.utils
import math
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from starlette_idempotency._types import REPLAY_HEADER, STRIPE_REPLAY_HEADER
from starlette_idempotency.errors import ConfigurationError

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "IdempotentTransport needs httpx: pip install 'starlette-idempotency[client]'"
    ) from exc

Rng = Callable[[], float]
"""Returns a float uniformly drawn from ``[0, 1)`` (``random.random``)."""

DEFAULT_RETRY_STATUSES: tuple[int, ...] = (409, 429, 500, 502, 503, 504)
"""Statuses retried with the same key (409 only when it carries ``Retry-After``)."""

# The request must change before it is sent again, and with it the key: the middleware stores
# none of its own 400s and 422s, but a status the handler returned (a 401 for a stale token) is
# stored like any other and replayed to every retry with that key.
NEW_KEY_STATUSES = frozenset({400, 401, 403, 422})
# Errors that say nothing about the server: retrying cannot help.
_NOT_RETRIED_ERRORS = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)
_DELTA_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")


def _check_number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        bound = "greater than 0" if positive else "at least 0"
        raise ConfigurationError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def check_statuses(statuses: Iterable[int]) -> frozenset[int]:
    if isinstance(statuses, str | bytes):
        raise ConfigurationError("retry_statuses must be a collection of status codes")
    checked = frozenset(statuses)
    for status in checked:
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ConfigurationError(
                f"retry_statuses must hold error statuses (400-599), got {status!r}"
            )
    forbidden = sorted(checked & NEW_KEY_STATUSES)
    if forbidden:
        raise ConfigurationError(
            f"retry_statuses must not contain {forbidden}: those answers mean the request "
            "must be fixed and sent with a new key, so retrying the same key cannot succeed"
        )
    return checked


def parse_retry_after(value: str, *, now: float) -> float | None:
    """Seconds to wait for a ``Retry-After`` value, or ``None`` when it is unreadable.

    Takes delta-seconds (``"3"``; fractions are accepted too) or an HTTP-date, read as GMT when
    it names no zone; ``now`` is epoch seconds, and a date already past gives 0.
    """
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        parsed = email.utils.parsedate_tz(value)
        if parsed is None:
            return None
        when = calendar.timegm(parsed[:6]) - (parsed[9] or 0)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - now)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Decides whether an idempotent attempt is retried with the same key, and after how long.

    It does no I/O and never sleeps, so the sync and async transports share it and differ only
    in how they send and wait; it can also be called directly.
    """

    max_attempts: int = 5
    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    deadline: float | None = None
    retry_statuses: frozenset[int] = field(default=frozenset(DEFAULT_RETRY_STATUSES))
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, got {attempts!r}")
        setattr_ = object.__setattr__
        setattr_(
            self, "backoff_base", _check_number("backoff_base", self.backoff_base, positive=False)
        )
        setattr_(
            self, "backoff_cap", _check_number("backoff_cap", self.backoff_cap, positive=False)
        )
        setattr_(
            self,
            "max_retry_after",
            _check_number("max_retry_after", self.max_retry_after, positive=False),
        )
        if self.deadline is not None:
            setattr_(self, "deadline", _check_number("deadline", self.deadline, positive=True))
        setattr_(self, "retry_statuses", check_statuses(self.retry_statuses))

    def backoff(self, retry: int, rng: Rng = random.random) -> float:
        """The wait before retry number ``retry`` (0 for the first retry)::

        min(backoff_base * 2**retry + jitter, backoff_cap), jitter = rng() * backoff_base * 2**retry
        """
        # Clamping the base first changes no result (the sum is capped anyway) and keeps huge
        # exponents from overflowing.
        base = min(self.backoff_base * 2.0 ** min(retry, 64), self.backoff_cap)
        return min(base + rng() * base, self.backoff_cap)

    def response_delay(
        self, response: httpx.Response, retry: int, *, rng: Rng = random.random, now: float
    ) -> float | None:
        """The wait before retrying after ``response``, or ``None`` when it is final.

        A ``Retry-After`` is a floor on the backoff, and final when it exceeds
        ``max_retry_after``. Ignores ``max_attempts`` and ``deadline``; see :meth:`next_delay`.
        ``now`` is epoch seconds, for a ``Retry-After`` HTTP-date.
        """
        if any(
            response.headers.get(name, "").strip().lower() == "true"
            for name in (REPLAY_HEADER, STRIPE_REPLAY_HEADER)
        ):
            return None  # the stored answer, whatever its status
        if response.status_code not in self.retry_statuses:
            return None
        header = response.headers.get("retry-after")
        retry_after = None if header is None else parse_retry_after(header, now=now)
        if retry_after is None:
            if response.status_code == 409:
                return None  # a conflict that is not "in progress, come back later"
            return self.backoff(retry, rng)
        if retry_after > self.max_retry_after:
            return None
        return max(retry_after, self.backoff(retry, rng))

    def error_delay(
        self, error: BaseException, retry: int, *, rng: Rng = random.random
    ) -> float | None:
        """The wait before retrying after a transport error, or ``None`` when it is final.

        Timeouts, connection errors and replies cut short are retried: the handler may or may
        not have run, which is what the key is for. Errors made on this side (an unsupported
        URL scheme, a malformed request) are not.
        """
        if not isinstance(error, httpx.TransportError) or isinstance(error, _NOT_RETRIED_ERRORS):
            return None
        return self.backoff(retry, rng)

    def next_delay(
        self,
        *,
        attempts: int,
        elapsed: float,
        response: httpx.Response | None = None,
        error: BaseException | None = None,
        rng: Rng = random.random,
        now: float | None = None,
    ) -> float | None:
        """The whole decision after attempt number ``attempts`` (1-based) ended ``elapsed``
        seconds after the first one began, with either ``response`` or ``error``: the wait
        before the next attempt, or ``None`` to stop and return the response or raise the
        error."""
        if attempts >= self.max_attempts:
            return None
        retry = attempts - 1
        if error is not None:
            delay = self.error_delay(error, retry, rng=rng)
        elif response is not None:
            delay = self.response_delay(
                response, retry, rng=rng, now=time.time() if now is None else now
            )
        else:
            raise TypeError("next_delay needs a response or an error")
        if delay is None:
            return None
        if self.deadline is not None and elapsed + delay > self.deadline:
            return None
        return delay
