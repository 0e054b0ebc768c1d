"""The client half of the protocol: httpx transports that send an ``Idempotency-Key`` and retry
with the same key until the server's answer is final.

Wrap any transport::

    client = httpx.Client(transport=IdempotentTransport())
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(httpx.AsyncHTTPTransport()))

POST and PATCH requests without a key get a fresh UUID4 key; a key the caller set is kept. Every
other method is sent once, untouched. For POST and PATCH the transport decides as follows:

===========================================  ==========  =====================================
What came back                               Retried?    Key
===========================================  ==========  =====================================
timeout, connection error, dropped reply     yes         same key (the handler may have run)
409 with ``Retry-After`` (in progress)       yes         same key, not before ``Retry-After``
429, 500, 502, 503, 504                      yes         same key, not before ``Retry-After``
``Retry-After`` above ``max_retry_after``    no          final: returned at once
a wait that would end after ``deadline``     no          final: returned (or raised) at once
``X-Idempotent-Replay: true`` (any status)   no          final: the stored answer
409 without a readable ``Retry-After``       no          final
400, 401, 403, 422                           never       fix the request, then use a new key
any other status                             no          final
===========================================  ==========  =====================================

The wait before retry ``n`` (``n = 0`` for the first retry) is::

    base    = backoff_base * 2**n
    backoff = min(base + jitter, backoff_cap)    jitter = rng() * base, uniform in [0, base)
    wait    = backoff                            without a readable Retry-After
    wait    = max(retry_after, backoff)          with one

so the first wait lies in ``[backoff_base, 2 * backoff_base)``. A ``Retry-After``
(delta-seconds or HTTP-date) on a retried response is a floor on the wait: the server may slow
the client down, never speed it up past its own backoff (whose jitter keeps clients that were
told the same thing from coming back together), and ``backoff_cap`` caps the computed backoff
only, never ``Retry-After``. A ``Retry-After`` longer than ``max_retry_after`` makes the
response final: it is returned at once rather than retried before the server said. So is one
that would cross the deadline. ``max_attempts`` counts every attempt, the first included.
``deadline`` bounds all attempts together: a retry whose wait would end after it is not made,
and the last response is returned (or the last error re-raised). Per-attempt time limits stay
with httpx's own ``timeout``.

A retry must send the same bytes, so the request body is read into memory before the first
attempt; a streaming body (generator, iterator, file) is refused up front with
:class:`NonReplayableRequestError`. Each POST/PATCH response is read into memory inside the
transport too, so a connection that drops in the middle of the response body is retried as well
(and the connection of a discarded response goes back to the pool).

Besides the standard library this module imports only httpx (and anyio, which httpx depends on)
and the package's Starlette-free ``_types`` and ``errors``; never Starlette.
"""

from __future__ import annotations

import calendar
import email.utils
import logging
import math
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import anyio

from starlette_idempotency._types import DEFAULT_HEADER_NAME, REPLAY_HEADER, Clock, system_clock
from starlette_idempotency.errors import ConfigurationError, IdempotencyError

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "IdempotentTransport needs httpx: pip install 'starlette-idempotency[client]'"
    ) from exc

logger = logging.getLogger(__name__)

Sleep = Callable[[float], None]
"""Blocks for the given number of seconds (``time.sleep``)."""

AsyncSleep = Callable[[float], Awaitable[None] | None]
"""Waits for the given number of seconds (``anyio.sleep``); a plain function that returns
``None`` is accepted too, which suits a recorder in tests."""

Rng = Callable[[], float]
"""Returns a float uniformly drawn from ``[0, 1)`` (``random.random``)."""

DEFAULT_RETRY_STATUSES: tuple[int, ...] = (409, 429, 500, 502, 503, 504)
"""Statuses retried with the same key (409 only when it carries ``Retry-After``)."""

IDEMPOTENT_METHODS = frozenset({"POST", "PATCH"})
"""Methods that get a key and retries; every other method is sent once, untouched."""

# The server stored nothing for these: the request must change, and with it the key.
_NEVER_RETRIED = frozenset({400, 401, 403, 422})
# Errors that say nothing about the server: retrying cannot help.
_NOT_RETRIED_ERRORS = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DELTA_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")


class NonReplayableRequestError(httpx.RequestError, IdempotencyError):
    """The request body is a stream that cannot be sent twice; pass the body as bytes
    (``content=b"..."``, ``data=``, ``json=`` or ``files=``) so a retry sends the same bytes."""

    def __init__(self, message: str, *, request: httpx.Request) -> None:
        super().__init__(message, request=request)


def _replayable_stream_types() -> tuple[type, ...]:
    kinds: list[type] = [httpx.ByteStream]
    try:
        from httpx._multipart import MultipartStream
    except ImportError:  # pragma: no cover - httpx moved it; multipart bodies are then refused
        pass
    else:
        kinds.append(MultipartStream)
    return tuple(kinds)


# Bodies already in memory (bytes, str, data=, json=, files= with seekable files).
_REPLAYABLE_STREAMS = _replayable_stream_types()


def _check_number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a finite number of seconds, got {value!r}")
    if value < 0 or (positive and value == 0):
        bound = "greater than 0" if positive else "at least 0"
        raise ConfigurationError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def _check_statuses(statuses: Iterable[int]) -> frozenset[int]:
    if isinstance(statuses, str | bytes):
        raise ConfigurationError("retry_statuses must be a collection of status codes")
    checked = frozenset(statuses)
    for status in checked:
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ConfigurationError(
                f"retry_statuses must hold error statuses (400-599), got {status!r}"
            )
    forbidden = sorted(checked & _NEVER_RETRIED)
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
        setattr_(self, "retry_statuses", _check_statuses(self.retry_statuses))

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
        if response.headers.get(REPLAY_HEADER, "").strip().lower() == "true":
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


class _Attempts:
    """One request's attempts so far, measured against the policy."""

    __slots__ = ("_clock", "_owner", "_request", "_started", "count", "key")

    def __init__(self, owner: _IdempotentBase, request: httpx.Request, key: str) -> None:
        self._owner = owner
        self._request = request
        self._clock = owner._clock
        self._started = self._clock()
        self.count = 0
        self.key = key

    def after(
        self, *, response: httpx.Response | None = None, error: BaseException | None = None
    ) -> float | None:
        self.count += 1
        now = self._clock()
        owner = self._owner
        delay = owner.policy.next_delay(
            attempts=self.count,
            elapsed=now - self._started,
            response=response,
            error=error,
            rng=owner._rng,
            now=now,
        )
        if delay is not None:
            outcome = repr(error) if response is None else response.status_code
            logger.debug(
                "retrying %s %s with %s %s in %.3fs: attempt %d of %d got %s",
                self._request.method,
                self._request.url,
                owner.header_name,
                self.key,
                delay,
                self.count,
                owner.policy.max_attempts,
                outcome,
            )
        return delay

    def give_up(self, error: BaseException) -> None:
        if self.count > 1:
            error.add_note(
                f"starlette_idempotency: gave up after {self.count} attempts "
                f"with {self._owner.header_name}: {self.key}"
            )


class _IdempotentBase:
    """What both transports share: options, the key, the body check, the retry bookkeeping."""

    def __init__(
        self,
        *,
        header_name: str,
        max_attempts: int,
        backoff_base: float,
        backoff_cap: float,
        max_retry_after: float,
        deadline: float | None,
        retry_statuses: Iterable[int],
        rng: Rng | random.Random,
        clock: Clock,
    ) -> None:
        if not isinstance(header_name, str) or not _TOKEN.fullmatch(header_name):
            raise ConfigurationError(
                f"header_name must be an HTTP header name, got {header_name!r}"
            )
        self.header_name = header_name
        self.policy = RetryPolicy(
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            max_retry_after=max_retry_after,
            deadline=deadline,
            retry_statuses=_check_statuses(retry_statuses),
        )
        self._rng: Rng = rng.random if isinstance(rng, random.Random) else rng
        self._clock = clock

    def _begin(self, request: httpx.Request) -> _Attempts | None:
        """``None`` for a request sent once as is; otherwise check the body and set the key.
        The caller reads the body before the first attempt."""
        if request.method.upper() not in IDEMPOTENT_METHODS:
            return None
        if not isinstance(request.stream, _REPLAYABLE_STREAMS):
            raise NonReplayableRequestError(
                f"{request.method} {request.url} has a streaming body "
                f"({type(request.stream).__name__}) that cannot be re-sent on a retry; "
                'pass the body as bytes (content=b"...", data=, json= or files=) instead',
                request=request,
            )
        key = request.headers.get(self.header_name)
        if key is None:
            key = str(uuid.uuid4())
            request.headers[self.header_name] = key
        return _Attempts(self, request, key)


def _rebuilt(response: httpx.Response, raw: bytes) -> httpx.Response:
    # A fresh, unread response: the client wraps and reads it as usual (``elapsed`` included)
    # and decodes ``raw`` according to the unchanged headers.
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=response.extensions,
    )


def _buffered(response: httpx.Response) -> httpx.Response:
    if isinstance(response.stream, httpx.ByteStream):
        return response
    try:
        raw = b"".join(response.iter_raw())
    finally:
        response.close()
    return _rebuilt(response, raw)


async def _abuffered(response: httpx.Response) -> httpx.Response:
    if isinstance(response.stream, httpx.ByteStream):
        return response
    try:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()
    return _rebuilt(response, raw)


class IdempotentTransport(_IdempotentBase, httpx.BaseTransport):
    """A sync httpx transport that adds an ``Idempotency-Key`` to POST and PATCH requests and
    retries them with the same key (see the module docstring for the table and the formula).

    :param transport: the transport that sends each attempt (``httpx.HTTPTransport()``).
    :param header_name: the key header; a key the caller set is kept.
    :param max_attempts: attempts in all, the first included.
    :param backoff_base: seconds; the first retry waits between it and twice it.
    :param backoff_cap: the longest computed backoff; a longer ``Retry-After`` is still
        waited in full.
    :param max_retry_after: seconds; a response whose ``Retry-After`` asks for longer is
        returned at once instead of retried.
    :param deadline: seconds for all attempts together, counted from the start of the first,
        or ``None`` for no limit.
    :param retry_statuses: statuses retried with the same key; 400, 401, 403 and 422 are refused.
    :param sleep: blocks for the given seconds (``time.sleep``); inject a recorder in tests.
    :param rng: uniform floats in ``[0, 1)`` for the jitter (``random.random``); a
        ``random.Random`` instance (seeded, say) is accepted too.
    :param clock: epoch seconds (``time.time``), for the deadline and ``Retry-After`` dates.
    """

    def __init__(
        self,
        transport: httpx.BaseTransport | None = None,
        *,
        header_name: str = DEFAULT_HEADER_NAME,
        max_attempts: int = 5,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        max_retry_after: float = 60.0,
        deadline: float | None = None,
        retry_statuses: Iterable[int] = DEFAULT_RETRY_STATUSES,
        sleep: Sleep = time.sleep,
        rng: Rng | random.Random = random.random,
        clock: Clock = system_clock,
    ) -> None:
        super().__init__(
            header_name=header_name,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            max_retry_after=max_retry_after,
            deadline=deadline,
            retry_statuses=retry_statuses,
            rng=rng,
            clock=clock,
        )
        if transport is not None and not hasattr(transport, "handle_request"):
            raise TypeError(f"transport must be an httpx.BaseTransport, got {transport!r}")
        self.transport = httpx.HTTPTransport() if transport is None else transport
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        attempts = self._begin(request)
        if attempts is None:
            return self.transport.handle_request(request)
        request.read()
        while True:
            try:
                response = _buffered(self.transport.handle_request(request))
            except httpx.TransportError as exc:
                delay = attempts.after(error=exc)
                if delay is None:
                    attempts.give_up(exc)
                    raise
            else:
                delay = attempts.after(response=response)
                if delay is None:
                    return response
            self._sleep(delay)

    def close(self) -> None:
        """Close the wrapped transport."""
        self.transport.close()


class AsyncIdempotentTransport(_IdempotentBase, httpx.AsyncBaseTransport):
    """The async twin of :class:`IdempotentTransport`, for ``httpx.AsyncClient``.

    Takes the same options; ``transport`` defaults to ``httpx.AsyncHTTPTransport()`` and
    ``sleep`` is a coroutine function (``anyio.sleep``, so asyncio and trio both work; a plain
    function is accepted too).
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        header_name: str = DEFAULT_HEADER_NAME,
        max_attempts: int = 5,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        max_retry_after: float = 60.0,
        deadline: float | None = None,
        retry_statuses: Iterable[int] = DEFAULT_RETRY_STATUSES,
        sleep: AsyncSleep = anyio.sleep,
        rng: Rng | random.Random = random.random,
        clock: Clock = system_clock,
    ) -> None:
        super().__init__(
            header_name=header_name,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            max_retry_after=max_retry_after,
            deadline=deadline,
            retry_statuses=retry_statuses,
            rng=rng,
            clock=clock,
        )
        if transport is not None and not hasattr(transport, "handle_async_request"):
            raise TypeError(f"transport must be an httpx.AsyncBaseTransport, got {transport!r}")
        self.transport = httpx.AsyncHTTPTransport() if transport is None else transport
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        attempts = self._begin(request)
        if attempts is None:
            return await self.transport.handle_async_request(request)
        await request.aread()
        while True:
            try:
                response = await _abuffered(await self.transport.handle_async_request(request))
            except httpx.TransportError as exc:
                delay = attempts.after(error=exc)
                if delay is None:
                    attempts.give_up(exc)
                    raise
            else:
                delay = attempts.after(response=response)
                if delay is None:
                    return response
            waiting = self._sleep(delay)
            if waiting is not None:
                await waiting

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self.transport.aclose()


__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "IDEMPOTENT_METHODS",
    "AsyncIdempotentTransport",
    "AsyncSleep",
    "IdempotentTransport",
    "NonReplayableRequestError",
    "RetryPolicy",
    "Rng",
    "Sleep",
    "parse_retry_after",
]
