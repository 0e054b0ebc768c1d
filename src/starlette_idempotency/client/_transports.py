"""The httpx transports that send an ``Idempotency-Key`` and retry with it (the package
docs hold the whole table)."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace

import anyio

from starlette_idempotency._types import (
    DEFAULT_HEADER_NAME,
    HTTP_TOKEN,
    Clock,
    monotonic_for,
    system_clock,
)
from starlette_idempotency.client._retry_policy import (
    DEFAULT_RETRY_STATUSES,
    NEW_KEY_STATUSES,
    RetryPolicy,
    Rng,
    check_statuses,
)
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
IDEMPOTENT_METHODS = frozenset({"POST", "PATCH"})
"""Methods that get a key and retries; every other method is sent once, untouched."""


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

# Failures before the request went out: nothing reached the server.
_NEVER_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

# httpx copies a request's extensions onto the request it builds for a redirect, together with
# its headers, so the key the transport generated follows it there; this note tells it apart.
_GENERATED_KEY_EXTENSION = "starlette_idempotency.generated_key"


@dataclass(frozen=True, slots=True)
class _GeneratedKey:
    """A key the transport generated, the request (method and URL) it is for, and whether an
    answer that needs a new key (400, 401, 403, 422) spent it."""

    key: str
    method: str
    url: httpx.URL
    spent: bool = False

    def usable_for(self, request: httpx.Request) -> bool:
        return not self.spent and request.method == self.method and request.url == self.url


class _Attempts:
    """One request's attempts so far, measured against the policy."""

    __slots__ = ("_generated", "_owner", "_reached", "_request", "_started", "count", "key")

    def __init__(
        self,
        owner: _IdempotentBase,
        request: httpx.Request,
        key: str,
        *,
        generated: _GeneratedKey | None,
    ) -> None:
        self._owner = owner
        self._request = request
        self._generated = generated
        self._started = owner._monotonic()
        #: Whether an attempt so far may have reached the server (and run the handler).
        self._reached = False
        self.count = 0
        self.key = key

    def after(
        self, *, response: httpx.Response | None = None, error: BaseException | None = None
    ) -> float | None:
        self.count += 1
        owner = self._owner
        delay = owner.policy.next_delay(
            attempts=self.count,
            elapsed=owner._monotonic() - self._started,
            response=response,
            error=error,
            rng=owner._rng,
            now=owner._clock(),
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
        if (
            self._generated is not None
            and not self._reached
            and response is not None
            and response.status_code in NEW_KEY_STATUSES
        ):
            # Never retried, so final. An auth flow (a refreshed token, DigestAuth) sends this
            # same request object again: a 401 the handler returned is stored under this key,
            # and only a new key gets past it. Only if no earlier attempt may have reached the
            # server: one whose answer was lost may have run the handler, and a new key would
            # run it again.
            self._request.extensions[_GENERATED_KEY_EXTENSION] = replace(
                self._generated, spent=True
            )
        self._reached = self._reached or not isinstance(error, _NEVER_SENT_ERRORS)
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
        if not isinstance(header_name, str) or not HTTP_TOKEN.fullmatch(header_name):
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
            retry_statuses=check_statuses(retry_statuses),
        )
        self._rng: Rng = rng.random if isinstance(rng, random.Random) else rng
        self._clock = clock
        self._monotonic = monotonic_for(clock)

    def _begin(self, request: httpx.Request) -> _Attempts | None:
        """``None`` for a request sent once as is; otherwise check the body and set the key.
        The caller reads the body before the first attempt."""
        self._drop_stale_generated_key(request)
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
        if key is not None:
            return _Attempts(self, request, key, generated=None)
        generated = _GeneratedKey(str(uuid.uuid4()), request.method, request.url)
        request.headers[self.header_name] = generated.key
        request.extensions[_GENERATED_KEY_EXTENSION] = generated
        return _Attempts(self, request, generated.key, generated=generated)

    def _drop_stale_generated_key(self, request: httpx.Request) -> None:
        """Take off a key this transport generated that no longer fits the request: one
        generated for the request a redirect (another URL, maybe another origin, or another
        method) was built from, where the server would answer 422 or another host learn it;
        or one an answer that needs a new key spent. A POST or PATCH then gets a new key. A
        key the caller set stays, wherever it goes."""
        generated: _GeneratedKey | None = request.extensions.get(_GENERATED_KEY_EXTENSION)
        if (
            generated is not None
            and request.headers.get(self.header_name) == generated.key
            and not generated.usable_for(request)
        ):
            del request.headers[self.header_name]


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
    Their responses are read whole before they are returned, so ``client.stream("POST", ...)``
    sees no byte before the last.

    :param transport: the transport that sends each attempt (``httpx.HTTPTransport()``). Give
        it the connection options (``proxy``, ``verify``, ``cert``, ``http2``, ``limits``,
        ``trust_env``): a client's own shape only a transport it builds, and its ``proxy=``
        mounts one that bypasses this transport.
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
    :param clock: epoch seconds (``time.time``), for ``Retry-After`` dates. The deadline is
        measured on its monotonic twin (``time.monotonic``, a ``FakeClock``'s ``monotonic``),
        so a wall clock stepped meanwhile moves it neither way.
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

    Takes the same options; ``transport`` defaults to ``httpx.AsyncHTTPTransport()`` (the
    connection options go on it, not on the client) and ``sleep`` is a coroutine function
    (``anyio.sleep``, so asyncio and trio both work; a plain function is accepted too).
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
