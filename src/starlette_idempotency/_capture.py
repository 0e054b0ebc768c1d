"""The ``send`` and ``receive`` an owning request's app is given.

:class:`ResponseCapture` passes the response on to the client while keeping a copy and settles
the outcome before the last body chunk goes out; :class:`ReplayingReceive` hands the app the
body the middleware already read.
"""

from __future__ import annotations

from typing import Protocol

from starlette_idempotency._types import Message, Receive, Send


class Outcome(Protocol):
    """Where a captured response's outcome goes (the key's owner)."""

    async def settle(
        self, status: int, raw_headers: list[tuple[bytes, bytes]], chunks: list[bytes] | None
    ) -> None:
        """Store or release the response's outcome; ``chunks`` is ``None`` when the body was
        not captured whole."""

    async def release(self, status: int | None) -> None:
        """Free the key: nothing was decided."""


class ResponseCapture:
    """The ``send`` the app gets: passes every message on to the client, keeps a copy of the
    response (up to ``max_response_bytes`` of body), and settles the outcome before the last
    body chunk goes out.

    Once the app has started its response the outcome is decided, however the response ends:
    a client that hangs up mid-stream, a ``send`` that raises, an app that stops its body on
    ``http.disconnect`` or raises half-way, a cancelled request task. Then
    :meth:`settle_unfinished` stores what was decided without the body it could not capture
    whole, so a retry never runs the handler again nor sees a truncated body as whole.
    """

    __slots__ = (
        "_max_response_bytes",
        "_outcome",
        "_send",
        "chunks",
        "ended",
        "raw_headers",
        "settled",
        "size",
        "status",
    )

    def __init__(self, send: Send, outcome: Outcome, max_response_bytes: int) -> None:
        self._send = send
        self._outcome = outcome
        self._max_response_bytes = max_response_bytes
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] | None = []  # None once the body outgrew max_response_bytes
        self.size = 0
        self.ended = False  # the app sent its last body chunk
        self.settled = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.raw_headers = list(message.get("headers", ()))
        elif kind == "http.response.body" and not self.ended:
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > self._max_response_bytes:
                self.chunks = None
            elif self.chunks is not None:
                self.chunks.append(chunk)
            if not message.get("more_body", False):
                self.ended = True
                await self._outcome.settle(self.status, self.raw_headers, self.chunks)
                self.settled = True
        await self._send(message)

    async def settle_unfinished(self) -> None:
        """Settle a request whose response did not run to its end (see the class docs)."""
        if not self.status:
            # The app raised or returned before it started a response: nothing was decided,
            # so the client may retry with the same key.
            await self._outcome.release(None)
            return
        body = self.chunks if self.ended else None
        await self._outcome.settle(self.status, self.raw_headers, body)


class ReplayingReceive:
    """A receive that hands the buffered body to the app once, then defers to the client
    (so the app still sees ``http.disconnect``)."""

    __slots__ = ("_body", "_receive")

    def __init__(self, body: bytes, receive: Receive) -> None:
        self._body: bytes | None = body
        self._receive = receive

    async def __call__(self) -> Message:
        body = self._body
        if body is None:
            return await self._receive()
        self._body = None
        return {"type": "http.request", "body": body, "more_body": False}
