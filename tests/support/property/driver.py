"""Calling an ASGI app with a request of our own making: headers, body chunks, pauses between
chunks (so concurrent requests interleave), a client that leaves, and a record of what was sent
back, with the ASGI protocol checked on the way."""

from __future__ import annotations

import asyncio
import itertools
import re
import traceback
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from starlette.types import ASGIApp, Message

from tests.support.property.apps import KEY_HEADER

ContentLength = Literal["exact", "absent", "garbage", "huge"]
Disconnect = Literal["none", "mid_body", "after_body"]
REQUEST_TIMEOUT_SECONDS = 15.0


def describe_bytes(data: bytes, limit: int = 400) -> str:
    """A readable repr: runs of one byte are written as ``b'[' * 300``, long tails cut."""
    parts: list[str] = []
    for match in re.finditer(rb"(.)\1{7,}|(?:(.)(?!\2{7}))+", data, re.DOTALL):
        run = match.group(0)
        if match.group(1) is not None:
            parts.append(f"{bytes(run[:1])!r} * {len(run)}")
        else:
            parts.append(repr(run))
    text = " + ".join(parts) or "b''"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(data)} bytes)"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as the client sends it. ``cuts`` are the offsets where the body is split
    into chunks (a repeated offset sends an empty chunk); ``pauses`` and ``handler_pauses``
    are event-loop yields before each chunk and inside the endpoint."""

    method: str = "POST"
    path: str = "/json"
    key_values: tuple[bytes, ...] = (b"k",)
    content_type: bytes | None = b"application/json"
    body: bytes = b"{}"
    cuts: tuple[int, ...] = ()
    pauses: int = 0
    handler_pauses: int = 0
    content_length: ContentLength = "exact"
    disconnect: Disconnect = "none"
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()

    def __repr__(self) -> str:
        shown = []
        for spec_field in fields(self):
            value = getattr(self, spec_field.name)
            if spec_field.name in ("method", "path", "body") or value != spec_field.default:
                text = describe_bytes(value) if spec_field.name == "body" else repr(value)
                shown.append(f"{spec_field.name}={text}")
        return f"RequestSpec({', '.join(shown)})"

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"host", b"testserver")]
        headers += [(KEY_HEADER.encode(), value) for value in self.key_values]
        if self.content_type is not None:
            headers.append((b"content-type", self.content_type))
        length = {
            "exact": str(len(self.body)).encode(),
            "garbage": b"12abc",
            "huge": b"99999999999",
        }.get(self.content_length)
        if length is not None:
            headers.append((b"content-length", length))
        if self.handler_pauses:
            headers.append((b"x-yields", str(self.handler_pauses).encode()))
        return headers + list(self.extra_headers)

    def chunks(self) -> list[bytes]:
        offsets = [0, *sorted(min(cut, len(self.body)) for cut in self.cuts), len(self.body)]
        return [self.body[start:end] for start, end in itertools.pairwise(offsets)]

    def same_request(self, other: RequestSpec) -> bool:
        """Byte for byte the same request as far as any app could tell."""
        return (self.method, self.path, self.content_type, self.body, self.extra_headers) == (
            other.method,
            other.path,
            other.content_type,
            other.body,
            other.extra_headers,
        )


@dataclass(slots=True)
class Exchange:
    """A request and everything the app sent back."""

    spec: RequestSpec
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)
    hung: bool = False
    protocol_errors: list[str] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    @property
    def replayed(self) -> bool:
        return self.header(b"x-idempotent-replay") == b"true"

    @property
    def serial(self) -> int | None:
        raw = self.header(b"x-serial")
        return int(raw) if raw is not None and raw.isdigit() else None

    @property
    def failed(self) -> bool:
        """What a client sees as a server error: a 5xx, an exception out of the app, no
        answer to a request it sent in full, or no end to it."""
        if self.error is not None or self.hung or self.protocol_errors:
            return True
        if self.status is None:
            return self.spec.disconnect != "mid_body"
        return self.status >= 500

    def describe(self) -> str:
        lines = [f"  request:  {self.spec!r}"]
        if self.status is not None:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.headers]
            lines.append(f"  response: {self.status} {headers}")
            lines.append(f"  body:     {describe_bytes(self.body)}")
        else:
            lines.append("  response: none")
        if not self.complete and self.status is not None:
            lines.append("  (response body never finished)")
        if self.hung:
            lines.append(f"  (no end after {REQUEST_TIMEOUT_SECONDS}s)")
        lines.extend(f"  protocol: {problem}" for problem in self.protocol_errors)
        if self.error:
            lines.append("  raised:   " + self.error.rstrip().replace("\n", "\n            "))
        return "\n".join(lines)


def _scope(spec: RequestSpec) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": spec.method,
        "scheme": "http",
        "path": spec.path,
        "raw_path": spec.path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": spec.headers(),
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }


async def call(app: ASGIApp, spec: RequestSpec) -> Exchange:
    """Send ``spec`` to ``app`` and record the answer."""
    exchange = Exchange(spec)
    chunks = spec.chunks()
    if spec.disconnect == "mid_body":
        chunks = chunks[: len(chunks) // 2]
    done = asyncio.Event()

    async def receive() -> Message:
        if chunks:
            for _ in range(spec.pauses):
                await asyncio.sleep(0)
            chunk = chunks.pop(0)
            more = bool(chunks) or spec.disconnect == "mid_body"
            return {"type": "http.request", "body": chunk, "more_body": more}
        if spec.disconnect == "none":
            await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        kind = message["type"]
        if exchange.complete:
            exchange.protocol_errors.append(f"{kind} after the response was complete")
        elif kind == "http.response.start":
            if exchange.status is not None:
                exchange.protocol_errors.append("http.response.start sent twice")
            exchange.status = message["status"]
            exchange.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif kind == "http.response.body":
            if exchange.status is None:
                exchange.protocol_errors.append("http.response.body before start")
            exchange.body += message.get("body", b"")
            if not message.get("more_body", False):
                exchange.complete = True
                done.set()

    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
            await app(_scope(spec), receive, send)
    except TimeoutError:
        exchange.hung = True
    except Exception as exc:
        exchange.exception = exc
        exchange.error = "".join(traceback.format_exception(exc, limit=-4))
    return exchange
