"""What is kept of a response, and how a kept one is read back for a replay."""

from __future__ import annotations

from starlette_idempotency._record import StoredResponse
from starlette_idempotency._responses import stored_response


class ResponseKeeper:
    """Turns a finished response into the copy the store keeps, and a kept copy back into
    the response a replay sends."""

    __slots__ = ("replay_header",)

    def __init__(self, *, replay_header_name: str) -> None:
        #: The replay header's name as ASGI headers carry it (lower-case bytes).
        self.replay_header = replay_header_name.lower().encode("latin-1")

    def keep(
        self, status: int, raw_headers: list[tuple[bytes, bytes]], body: bytes | None
    ) -> StoredResponse:
        """The copy of a response the store keeps; ``body`` is ``None`` when it was not
        captured whole."""
        return stored_response(status, raw_headers, body, self.replay_header.decode("latin-1"))
