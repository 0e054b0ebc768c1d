"""HTTP answers the middleware gives itself: errors (JSON, RFC 9457 problem details, or a body
the application builds) and replays of stored responses. Stores never build responses; this is
the one place that maps outcomes to HTTP."""

from __future__ import annotations

import enum
import inspect
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from starlette_idempotency._record import IdempotencyRecord, StoredResponse
from starlette_idempotency._types import Receive, Scope, Send
from starlette_idempotency.errors import ConfigurationError

# The middleware's own answers hold for this request only: no shared cache may keep a 409.
_NO_STORE = (b"cache-control", b"no-store")


class Problem(enum.Enum):
    """Every error the middleware answers with.

    Each has its status, its stable machine-readable ``code`` (in every error format; a code
    never changes meaning), the coarse ``error_type`` of the ``"stripe"`` format (Stripe's
    vocabulary) and its problem title.
    """

    MISSING_KEY = (400, "idempotency_key_missing", "invalid_request_error", "{header} is missing")
    INVALID_KEY = (400, "idempotency_key_invalid", "invalid_request_error", "{header} is invalid")
    INVALID_REQUEST = (400, "request_malformed", "invalid_request_error", "Request is malformed")
    BODY_TOO_LARGE = (
        413,
        "request_body_too_large",
        "invalid_request_error",
        "Request body is too large",
    )
    IN_PROGRESS = (
        409,
        "idempotency_key_in_use",
        "idempotency_error",
        "A request is outstanding for this {header}",
    )
    ALREADY_PROCESSED = (
        409,
        "idempotency_key_already_processed",
        "idempotency_error",
        "{header} was already processed",
    )
    MISMATCH = (422, "idempotency_key_reused", "idempotency_error", "{header} is already used")
    STORE_UNAVAILABLE = (
        503,
        "idempotency_store_unavailable",
        "api_error",
        "Idempotency store is unavailable",
    )
    RESPONSE_UNREADABLE = (
        503,
        "idempotency_response_unreadable",
        "api_error",
        "Stored response cannot be read",
    )

    status: int
    code: str
    error_type: str
    title: str

    def __init__(self, status: int, code: str, error_type: str, title: str) -> None:
        self.status = status
        self.code = code
        self.error_type = error_type
        self.title = title

    def type_uri(self, base: str) -> str:
        """This problem's ``type`` under ``error_format="problem"``: ``base`` followed by the
        code's own segment (``https://errors.example.com/idempotency/key-in-use``), or
        ``about:blank`` for that base, which names no type of its own (RFC 9457 4.2.1)."""
        if base == "about:blank":
            return base
        segment = self.code.removeprefix("idempotency_").replace("_", "-")
        return f"{base.rstrip('/')}/{segment}"


@dataclass(frozen=True, slots=True)
class IdempotencyProblem:
    """One error answer, as an ``error_format`` callable receives it.

    ``code`` is stable (see :class:`Problem`); ``title`` names the kind of problem with the
    configured header (or the route's key source); ``detail`` is this occurrence's message.
    A 422 for a key reused with another request names the first request's outcome:
    ``first_status`` and, when its response had one, ``first_location`` (``None`` while the
    first request is still running).
    """

    status: int
    code: str
    title: str
    detail: str
    first_status: int | None = None
    first_location: str | None = None


@dataclass(frozen=True, slots=True)
class FirstRequest:
    """What a 422 tells of the request that first used the key: its status and ``Location``,
    never its body."""

    status: int
    location: str | None

    def as_json(self) -> dict[str, Any]:
        """``{"status": ..., "location": ...}``, without ``location`` when there is none."""
        if self.location is None:
            return {"status": self.status}
        return {"status": self.status, "location": self.location}


ErrorBody = Callable[[IdempotencyProblem], dict[str, Any]]
"""Builds the JSON object sent (as ``application/json``) for an error: ``error_format=``."""

ErrorFormat = Literal["json", "problem", "stripe"] | ErrorBody
"""``"json"`` (``{"error": "<message>", "code": "<code>"}``), ``"problem"`` (RFC 9457),
``"stripe"`` (``{"error": {"type", "code", "message"}}``, what Stripe's SDKs parse) or an
:data:`ErrorBody` callable."""
_ERROR_FORMATS = ("json", "problem", "stripe")
_STRIPE_SDK_HEADER = b"x-stripe-client-user-agent"


IN_PROGRESS_MESSAGE = (
    "A request with this idempotency key is already being processed. "
    "Retry after the original request completes."
)
MISMATCH_MESSAGE = "Idempotency key has already been used with a different request payload."
ALREADY_PROCESSED_MESSAGE = (
    "A request with this idempotency key was already processed; its response is not replayed."
)
STORE_UNAVAILABLE_MESSAGE = "The idempotency store is unavailable. Retry later with the same key."
RESPONSE_UNREADABLE_MESSAGE = (
    "The stored response for this idempotency key cannot be decrypted; the request is not run "
    "again. Retry later with the same key."
)

# A duplicate is told to come back after this share of the time the first request has run.
_RETRY_AFTER_SHARE = 0.25


def retry_after_seconds(record: IdempotencyRecord | None, now: float) -> int:
    """``Retry-After`` for a duplicate of a request still in progress, in whole seconds.

    A quarter of the time the first request has run so far (``now - created_at``), rounded up,
    at least 1 and at most the seconds left on its lock (``locked_until`` for a record with
    recovery points, else ``expires_at``). The answer then comes at most a quarter of the first
    request's own duration (and at least a second) after it is ready, and a client that honours
    every hint asks about ``log(duration) / log(1.25)`` times instead of once a second. ``1``
    when the record is unknown.
    """
    if record is None:
        return 1
    lock_ends = record.expires_at if record.locked_until is None else record.locked_until
    share = math.ceil((now - record.created_at) * _RETRY_AFTER_SHARE)
    return max(1, min(share, math.ceil(lock_ends - now)))


class ErrorResponder:
    """Sends error responses in the configured format."""

    def __init__(self, *, header_name: str, error_format: ErrorFormat, problem_type: str) -> None:
        self._build: ErrorBody | None = None
        if callable(error_format):
            self._build = error_format
        elif error_format not in _ERROR_FORMATS:
            raise ConfigurationError(
                f"error_format must be 'json', 'problem', 'stripe' or a callable, "
                f"not {error_format!r}"
            )
        self._problem = error_format == "problem"
        self._stripe = error_format == "stripe"
        self._json = error_format == "json"
        self._types = {problem: problem.type_uri(problem_type) for problem in Problem}
        self._titles = {problem: problem.title.format(header=header_name) for problem in Problem}
        self._content_type = b"application/problem+json" if self._problem else b"application/json"
        if self._build is not None:
            self._check_build()

    def _check_build(self) -> None:
        """Call the ``error_format`` callable once, so that a broken one fails at startup
        rather than turning the first error answer into a 500."""
        try:
            body = self._body(Problem.IN_PROGRESS, IN_PROGRESS_MESSAGE)
            if not isinstance(body, dict):
                raise TypeError(f"it returned {type(body).__name__}")
            orjson.dumps(body)
        except Exception as exc:
            raise ConfigurationError(
                f"error_format {self._build!r} must return a JSON-serialisable dict: {exc}"
            ) from exc

    def _body(
        self,
        problem: Problem,
        detail: str,
        stripe_sdk: bool = False,
        *,
        key_name: str | None = None,
        first: FirstRequest | None = None,
    ) -> dict[str, Any]:
        title = self._titles[problem] if key_name is None else problem.title.format(header=key_name)
        if self._build is not None:
            return self._build(
                IdempotencyProblem(
                    problem.status,
                    problem.code,
                    title,
                    detail,
                    None if first is None else first.status,
                    None if first is None else first.location,
                )
            )
        body: dict[str, Any]
        if self._problem:
            body = {
                "type": self._types[problem],
                "title": title,
                "status": problem.status,
                "detail": detail,
                "code": problem.code,
            }
        elif self._stripe or stripe_sdk:
            error: dict[str, Any] = {
                "type": problem.error_type,
                "code": problem.code,
                "message": detail,
            }
            if first is not None:
                error["first_request"] = first.as_json()
            return {"error": error}
        else:
            body = {"error": detail, "code": problem.code}
        if first is not None:
            body["first_request"] = first.as_json()
        return body

    async def send(
        self,
        send: Send,
        problem: Problem,
        detail: str,
        *,
        retry_after: int | None = None,
        location: str | None = None,
        request_headers: Iterable[tuple[bytes, bytes]] = (),
        key_name: str | None = None,
        first: FirstRequest | None = None,
    ) -> None:
        """Send ``problem`` in the configured format; its title names ``key_name`` (a route's
        key source) instead of the header, when given, and its body ``first``.

        A ``"json"`` error to one of Stripe's SDKs (they send ``X-Stripe-Client-User-Agent``)
        takes the ``"stripe"`` shape: their parser reads ``error`` as an object and fails with
        an ``AttributeError`` on the string, instead of raising a catchable ``StripeError``.
        """
        stripe_sdk = self._json and any(name == _STRIPE_SDK_HEADER for name, _ in request_headers)
        body = orjson.dumps(self._body(problem, detail, stripe_sdk, key_name=key_name, first=first))
        headers = [
            (b"content-type", self._content_type),
            (b"content-length", str(len(body)).encode("latin-1")),
            _NO_STORE,
        ]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode("latin-1")))
        if location is not None:
            headers.append((b"location", location.encode("latin-1")))
        await send({"type": "http.response.start", "status": problem.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def send_replay(send: Send, response: StoredResponse, replay_header: bytes) -> None:
    """Replay a stored response byte for byte, marked with ``replay_header: true`` (the
    lower-case name of the middleware's ``replay_header_name``)."""
    headers = []
    for name, value in response.headers:  # a loop: a comprehension is a call of its own
        headers.append((name.encode("latin-1"), value.encode("latin-1")))
    headers.append((replay_header, b"true"))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


#: The headers that describe a response's body: kept or dropped with it.
BODY_HEADERS = frozenset({"content-length", "content-type", "content-encoding"})
BODY_OMITTED_HEADER = ("x-idempotent-body-omitted", "true")


# A stored body decoded for a client that did not accept its encoding may grow this far.
_MAX_DECODED_BYTES = 64 * 1024 * 1024
_ZLIB_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}


def _accepts(accept_encoding: str, coding: str) -> bool:
    """Whether an ``Accept-Encoding`` value accepts ``coding`` (RFC 9110 12.5.3).

    No header at all counts as identity only: curl and most SDKs send none and cannot read a
    compressed body.
    """
    for part in accept_encoding.lower().split(","):
        name, _, params = part.partition(";")
        if name.strip() not in (coding, "*"):
            continue
        quality = params.strip().removeprefix("q=")
        try:
            return not params.strip() or float(quality) > 0
        except ValueError:
            return True
    return False


def replay_for(
    response: StoredResponse, request_headers: Iterable[tuple[bytes, bytes]]
) -> StoredResponse:
    """The stored response as this client can read it.

    A response stored with a ``Content-Encoding`` (a compressing middleware ran inside this
    one) is decoded for a client that does not accept that encoding when it is gzip or deflate,
    and replayed without its body (``X-Idempotent-Body-Omitted``) when it cannot be decoded.
    """
    coding = (response.header("content-encoding") or "identity").strip().lower()
    if coding == "identity":
        return response
    accept_encoding = b",".join(v for k, v in request_headers if k == b"accept-encoding")
    if _accepts(accept_encoding.decode("latin-1"), coding):
        return response
    body: bytes | None = None
    if coding in _ZLIB_WBITS:
        decoder = zlib.decompressobj(_ZLIB_WBITS[coding])
        try:
            decoded = decoder.decompress(response.body, _MAX_DECODED_BYTES)
        except zlib.error:
            decoded = None
        if decoded is not None and decoder.eof and not decoder.unconsumed_tail:
            body = decoded
    headers = [(name, value) for name, value in response.headers if name not in BODY_HEADERS]
    if body is None:
        headers.append(BODY_OMITTED_HEADER)
    else:
        headers += [(name, value) for name, value in response.headers if name == "content-type"]
        headers.append(("content-length", str(len(body))))
    return StoredResponse(response.status_code, tuple(headers), body or b"", response.content_type)


async def send_requires_recovery(send: Send, checkpoint: str) -> None:
    """202 for a key whose first attempt died after a recovery point (``on_recovery="hold"``)."""
    body = orjson.dumps(
        {
            "status": "requires_recovery",
            "checkpoint": checkpoint,
            "detail": "The first attempt stopped after a recovery point; the outcome is being "
            "reconciled. Retry later with the same key.",
        }
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        _NO_STORE,
    ]
    await send({"type": "http.response.start", "status": 202, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_http_exception(
    exc: HTTPException, scope: Scope, receive: Receive, send: Send
) -> None:
    """Answer an ``HTTPException`` raised before the app ran (by ``key_scope`` or ``key_from``)
    as the app answers it: through its own handler for the status code or the exception, if it
    has one (FastAPI's JSON ``{"detail": ...}``, or the app's), else as Starlette's default does."""
    handler = _http_exception_handler(scope, exc)
    response: Any
    if handler is not None:
        response = handler(Request(scope, receive), exc)
        if inspect.isawaitable(response):
            response = await response
    elif exc.status_code in (204, 304):
        response = Response(status_code=exc.status_code, headers=exc.headers)
    else:
        response = PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    await response(scope, receive, send)


def _http_exception_handler(scope: Scope, exc: HTTPException) -> Callable[..., Any] | None:
    """The handler Starlette's ``ExceptionMiddleware`` picks for ``exc`` (its
    ``wrap_app_handling_exceptions``, private to Starlette): the one for its status code, else
    the nearest in its MRO. The ``500`` and ``Exception`` handlers are not among them: Starlette
    gives those to ``ServerErrorMiddleware``, for errors no other handler answered."""
    handlers: dict[Any, Callable[..., Any]] = {
        key: handler
        for key, handler in (getattr(scope.get("app"), "exception_handlers", None) or {}).items()
        if key not in (500, Exception)
    }
    if exc.status_code in handlers:
        return handlers[exc.status_code]
    return next((handlers[kind] for kind in type(exc).__mro__ if kind in handlers), None)
