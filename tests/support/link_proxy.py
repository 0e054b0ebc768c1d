"""A TCP proxy whose link a test can hold and cut: a replication link that lags, then breaks,
or a database whose replies come late.

A Redis replica connects to its primary through it, or a store to PostgreSQL. While
:meth:`LinkProxy.hold` is on, what the upstream server sends is kept back (the client hears
nothing, as behind a slow network); :meth:`release` forwards it, and :meth:`cut` drops it and
closes every connection, as a server that fails does. Once :meth:`keep_ends` is on, a
connection the server closes unasked stays open towards its client after its last bytes, as
while a terminated backend is still exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Self
from urllib.parse import urlsplit, urlunsplit


def proxied(dsn: str, port: int) -> str:
    """``dsn`` (a URL) with its host and port replaced by a proxy's on 127.0.0.1:``port``."""
    parts = urlsplit(dsn)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


class _Exchange:
    """What the two directions of one proxied connection know of each other."""

    def __init__(self) -> None:
        #: The client sent something the upstream has not answered yet (an end then
        #: answers the client's farewell, and is never kept back).
        self.asked = False
        #: The upstream closed the connection unasked, and the client has not heard of it.
        self.end_kept = False


class LinkProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream_port``; holds the upstream's replies on demand."""

    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self._open = asyncio.Event()
        self._open.set()
        self._hold_on: bytes | None = None  # see hold()
        self._keeping_ends = False  # see keep_ends()
        #: How many ends of connections have been kept back from their clients.
        self.kept_ends = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cut()

    def proxied(self, dsn: str) -> str:
        """``dsn`` pointed at this proxy."""
        return proxied(dsn, self.port)

    def hold(self, *, on: bytes | None = None) -> None:
        """Keep back what the upstream sends from now on; with ``on``, from the moment a
        client sends those bytes (``b"COMMIT"``): its reply is the first kept back."""
        if on is None:
            self._open.clear()
        else:
            self._hold_on = on

    def release(self) -> None:
        """Forward what was kept back, and everything after it."""
        self._open.set()

    def keep_ends(self) -> None:
        """From now on, forward what the upstream sends but not its end when it closes a
        connection unasked (with nothing of the client's left to answer): the connection stays
        open towards the client, silent, until the client sends on it or closes it."""
        self._keeping_ends = True

    def drop(self) -> None:
        """Close every connection at once, with no word to either end (a network that drops
        them, a server that crashed); new connections are still taken."""
        for writer in self._writers:
            # Shut down at once: the transport itself closes the socket only on the loop's next
            # turn, when the other end's transport (on this loop too) would read it first.
            with contextlib.suppress(OSError):
                writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            writer.transport.abort()
        self._writers.clear()

    async def cut(self) -> None:
        """Drop what was kept back and close every connection, taking no new one."""
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        self._open.set()
        await self._server.wait_closed()

    async def _serve(self, client_in: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        server_in, server = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        self._writers += [client, server]
        exchange = _Exchange()
        try:
            await asyncio.gather(
                self._requests(client_in, server, exchange),
                self._replies(server_in, client, exchange),
            )
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # cut, or closed by either end (a cut task ends quietly: it is ours)
        finally:
            self._tasks.discard(task)
            for writer in (client, server):
                writer.transport.abort()

    async def _requests(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, exchange: _Exchange
    ) -> None:
        while data := await source.read(65536):
            if exchange.end_kept:  # it reaches a client that speaks
                break
            exchange.asked = True
            if self._hold_on is not None and self._hold_on in data:
                self._hold_on = None
                self._open.clear()  # before the request goes: its reply is held
            sink.write(data)
            with contextlib.suppress(ConnectionError):
                await sink.drain()
        sink.transport.abort()

    async def _replies(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, exchange: _Exchange
    ) -> None:
        while data := await source.read(65536):
            exchange.asked = False
            await self._open.wait()
            sink.write(data)
            with contextlib.suppress(ConnectionError):
                await sink.drain()
        exchange.end_kept = self._keeping_ends and not exchange.asked
        if exchange.end_kept:
            self.kept_ends += 1
        else:
            sink.transport.abort()
