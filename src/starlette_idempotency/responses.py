"""HTTP answers the middleware gives itself: errors (JSON or RFC 9457 problem details) and
replays of stored responses. Stores never build responses; this is the one place that maps
outcomes to HTTP."""

from __future__ import annotations

import enum
import math
from typing import Literal

import orjson

from starlette_idempotency._types import REPLAY_HEADER, Send
from starlette_idempotency.record import StoredResponse

ErrorFormat = Literal["json", "problem"]

_REPLAY_HEADER = (REPLAY_HEADER.lower().encode("latin-1"), b"true")


class Problem(enum.Enum):
    """The errors the middleware answers with: (status, problem title)."""

    MISSING_KEY = (400, "{header} is missing")
    INVALID_KEY = (400, "{header} is invalid")
    BODY_TOO_LARGE = (413, "Request body is too large")
    IN_PROGRESS = (409, "A request is outstanding for this {header}")
    ALREADY_PROCESSED = (409, "{header} was already processed")
    MISMATCH = (422, "{header} is already used")
    STORE_UNAVAILABLE = (503, "Idempotency store is unavailable")

    @property
    def status(self) -> int:
        return self.value[0]


IN_PROGRESS_MESSAGE = (
    "A request with this idempotency key is already being processed. "
    "Retry after the original request completes."
)
MISMATCH_MESSAGE = "Idempotency key has already been used with a different request payload."
ALREADY_PROCESSED_MESSAGE = (
    "A request with this idempotency key was already processed; its response is not replayed."
)
STORE_UNAVAILABLE_MESSAGE = "The idempotency store is unavailable. Retry later with the same key."


def retry_after_seconds(remaining: float) -> int:
    """Whole seconds for ``Retry-After``: the remaining time rounded up, at least 1."""
    return max(1, math.ceil(remaining))


class ErrorResponder:
    """Sends error responses in the configured format."""

    def __init__(self, *, header_name: str, error_format: ErrorFormat, problem_type: str) -> None:
        if error_format not in ("json", "problem"):
            raise ValueError("error_format must be 'json' or 'problem'")
        self._header_name = header_name
        self._problem = error_format == "problem"
        self._problem_type = problem_type
        self._content_type = b"application/problem+json" if self._problem else b"application/json"

    async def send(
        self,
        send: Send,
        problem: Problem,
        detail: str,
        *,
        retry_after: int | None = None,
        location: str | None = None,
    ) -> None:
        if self._problem:
            payload: dict[str, object] = {
                "type": self._problem_type,
                "title": problem.value[1].format(header=self._header_name),
                "status": problem.status,
                "detail": detail,
            }
        else:
            payload = {"error": detail}
        body = orjson.dumps(payload)
        headers = [
            (b"content-type", self._content_type),
            (b"content-length", str(len(body)).encode("latin-1")),
        ]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode("latin-1")))
        if location is not None:
            headers.append((b"location", location.encode("latin-1")))
        await send({"type": "http.response.start", "status": problem.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def send_replay(send: Send, response: StoredResponse) -> None:
    """Replay a stored response byte for byte, marked with ``X-Idempotent-Replay: true``."""
    headers = [
        (name.encode("latin-1"), value.encode("latin-1")) for name, value in response.headers
    ]
    headers.append(_REPLAY_HEADER)
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


_NOT_STORED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "date",
        "server",
        "set-cookie",
        REPLAY_HEADER.lower(),
    }
)


_BODY_HEADERS = frozenset({"content-length", "content-type", "content-encoding"})
BODY_OMITTED_HEADER = ("x-idempotent-body-omitted", "true")


def stored_response(
    status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes | None
) -> StoredResponse:
    """The response as it is stored: no hop-by-hop headers, no Date, Server or Set-Cookie.

    ``body`` is ``None`` when it outgrew ``max_response_bytes``: then the status and headers
    are kept, the body headers dropped, and ``X-Idempotent-Body-Omitted: true`` added.
    """
    headers = []
    for raw_name, raw_value in raw_headers:
        name = raw_name.decode("latin-1").lower()
        if name in _NOT_STORED_HEADERS or (body is None and name in _BODY_HEADERS):
            continue
        headers.append((name, raw_value.decode("latin-1")))
    if body is None:
        headers.append(BODY_OMITTED_HEADER)
    content_type = next((value for name, value in headers if name == "content-type"), None)
    return StoredResponse(status, tuple(headers), body or b"", content_type)


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
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 202, "headers": headers})
    await send({"type": "http.response.body", "body": body})
