"""A TCP proxy in front of PostgreSQL that loses one exchange the way a network does.

The store connects through it; the test arms it to cut the next exchange. ``cut_request``
drops what the client sends next and closes the client's connection: the statement never
reaches the server. ``cut_reply`` lets the statement through and drops the server's reply up to
its ReadyForQuery, then closes the client's connection: the statement ran and committed, but
the client only sees its connection die, with no word from the server.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal, Self

from tests.support.link_proxy import proxied

# A ReadyForQuery message is "Z", a length of 5, and one status byte: it ends a reply.
_READY_FOR_QUERY = b"Z\x00\x00\x00\x05"

Cut = Literal["request", "reply"]


class CuttingProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream``, counting client connections."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self.connections = 0
        self.cuts_done = 0
        self._armed: Cut | None = None
        self._on: bytes | None = None  # the bytes of the request to cut, when given
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def proxied(self, dsn: str) -> str:
        """``dsn`` pointed at this proxy."""
        return proxied(dsn, self.port)

    def arm(self, cut: Cut, *, on: bytes | None = None) -> None:
        """Cut the next exchange of any connection (one cut only); with ``on``, the next whose
        request holds those bytes (``b"COMMIT"``)."""
        self._armed = cut
        self._on = on

    def _take(self, cut: Cut) -> bool:
        if self._armed != cut or self._on is not None:
            return False
        self._armed = None
        self.cuts_done += 1
        return True

    async def _serve(self, client_in: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server_in, server = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        try:
            await asyncio.gather(
                self._requests(client_in, server, client), self._replies(server_in, client)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            for writer in (client, server):
                writer.transport.abort()

    async def _requests(
        self,
        client_in: asyncio.StreamReader,
        server: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
    ) -> None:
        while data := await client_in.read(65536):
            if self._on is not None and self._on in data:
                self._on = None  # this exchange is the one to cut
            if self._take("request"):
                client.transport.abort()
                server.transport.abort()
                return
            server.write(data)
            await server.drain()
        server.transport.abort()

    async def _replies(self, server_in: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        swallowing = False
        while data := await server_in.read(65536):
            if swallowing or self._take("reply"):
                swallowing = True
                # A reply is complete with ReadyForQuery, sent last: by then it has committed.
                if data[-6:-1] == _READY_FOR_QUERY:
                    client.transport.abort()
                    return
                continue
            client.write(data)
            with contextlib.suppress(ConnectionError):
                await client.drain()
        client.transport.abort()
