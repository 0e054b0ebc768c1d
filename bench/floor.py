"""The floor: the least an idempotency layer can do, hand-written as pure ASGI.

Unique key: one ``SET key "" NX PX 30000 GET`` before the handler and one ``SET key response EX``
after it. Replay: the same single ``SET NX GET`` returns the stored response. No fingerprint, no
record format (the value is the 3-digit status followed by the body), no owner token, no
response headers kept: everything the library adds on top of this is what the benchmark prices.
The commands go to Redis through redis-py (``floor-redis``) or to a dict in the process
(``floor-memory``, :class:`DictFloorClient`).

``floor-memory-checked`` (``check_body=True``) is the least a layer that answers 422 to a key
reused with another body can do: it also reads the body, keeps its SHA-256 (raw bytes, no
canonical form) beside the response and compares it on a replay. A layer that answers a replay
without reading the body (asgi-idempotency-header) is measured against ``floor-memory``; one
that keeps the 422 promise cannot be cheaper than this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOCK_TTL_MS = 30_000
RETENTION_SECONDS = 24 * 3600
_IN_PROGRESS = b""
_KEY_HEADER = b"idempotency-key"
_CONFLICT_BODY = b'{"error":"in progress"}'
_MISMATCH_BODY = b'{"error":"key reused with another body"}'
_DIGEST_SIZE = 32


class FloorClient(Protocol):
    """The two ``redis.asyncio.Redis`` methods the floor uses."""

    def set(self, name: Any, value: Any, *args: Any, **kwargs: Any) -> Awaitable[Any]: ...

    def delete(self, *names: Any) -> Awaitable[Any]: ...


class DictFloorClient:
    """``SET NX GET`` and ``DEL`` over a dict: the floor of an in-process store (no expiry)."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}

    async def set(
        self, name: bytes, value: bytes, *, nx: bool = False, get: bool = False, **_: Any
    ) -> bytes | None:
        current = self._values.get(name)
        if not (nx and current is not None):
            self._values[name] = value
        return current if get else None

    async def delete(self, *names: bytes) -> None:
        for name in names:
            self._values.pop(name, None)


class FloorMiddleware:
    """Guards ``POST <path>`` requests that carry an ``Idempotency-Key`` header."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        client: FloorClient,
        prefix: str,
        path: str = "/payments",
        check_body: bool = False,
    ) -> None:
        self.app = app
        self.client = client
        self.prefix = prefix.encode("latin-1") + b":"
        self.path = path
        self.check_body = check_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        key = next((value for name, value in scope["headers"] if name == _KEY_HEADER), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        skey = self.prefix + key
        digest = b""
        if self.check_body:
            body = await _read_body(receive)
            digest = hashlib.sha256(body).digest()
            receive = _replaying(body, receive)
        stored = await self.client.set(skey, _IN_PROGRESS, nx=True, px=LOCK_TTL_MS, get=True)
        if stored is not None:
            answer = stored[3 + len(digest) :]
            if stored == _IN_PROGRESS:
                await _send(send, 409, _CONFLICT_BODY)
            elif stored[3 : 3 + len(digest)] != digest:
                await _send(send, 422, _MISMATCH_BODY)
            else:
                await _send(send, int(stored[:3]), answer)
            return
        status = 0
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    value = b"%03d" % status + digest + b"".join(chunks)
                    await self.client.set(skey, value, ex=RETENTION_SECONDS)
            await send(message)

        try:
            await self.app(scope, receive, capture)
        except BaseException:
            await self.client.delete(skey)
            raise


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body read already, in one message, then the client's."""
    pending = [{"type": "http.request", "body": body}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("latin-1")),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
