"""What :class:`~starlette_idempotency.stores.redis.RedisStore` needs from a Redis client library.

The store holds the record logic (acquire, takeover, fenced writes); a driver sends its commands
through one client library: redis-py (:mod:`.redis_py`) or valkey-glide (:mod:`.redis_glide`).
Drivers hand the store the library's own callables where they can (:attr:`RedisDriver.scripts`,
:attr:`RedisDriver.set_command`), so no frame of theirs sits between the store and the library
on the hot path.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.resources
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

#: A command argument: the store passes numbers as decimal strings.
Arg = bytes | str
#: A script run on the server, called ``(keys, args)``; it resolves to the script's reply.
ScriptCall = Callable[[list[str], list[Arg]], Awaitable[Any]]
#: The scripts a driver runs by name (``abandon``, sent whole, is not among them).
SCRIPTS = ("acquire", "claim", "finish", "progress", "recover", "release", "renew", "unclaim")

_NEEDS_RECORD_PRELUDE = frozenset({"abandon", "finish", "progress", "recover", "release", "renew"})


@functools.cache
def lua_source(name: str) -> str:
    """A script's source; those that read the stored record get ``_record.lua`` first."""
    lua = importlib.resources.files("starlette_idempotency.stores.redis").joinpath("lua")
    source = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in _NEEDS_RECORD_PRELUDE:
        source = lua.joinpath("_record.lua").read_text(encoding="utf-8") + source
    return source


class CommandBatch(Protocol):
    """Where the commands made in one turn of the event loop after its first wait for the
    turn's end, to go out together: the acquires' ``SET`` and the finishes' script (see
    :class:`RedisStore`'s ``_set_nx_get`` and ``finish``)."""

    #: The loop whose turn made a command that went out at once, until that turn ends (the
    #: loop clears it).
    turn: list[asyncio.AbstractEventLoop]

    def set(self, args: tuple[Arg, ...], loop: asyncio.AbstractEventLoop) -> Awaitable[Any]:
        """``SET *args`` (with ``GET``'s reply as it came), sent once the turn has ended."""
        ...

    def script(
        self, name: str, key: str, args: list[Arg], loop: asyncio.AbstractEventLoop
    ) -> Awaitable[Any]:
        """The script of :data:`SCRIPTS` called ``name`` on ``key`` with ``args``, sent once
        the turn has ended (and again after loading it, should the server have lost it)."""
        ...

    def in_flight(self, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Task[None], ...]:
        """``loop``'s batches not yet ended: one may still send a command whose caller gave
        up."""
        ...


class Subscription(Protocol):
    """One pub/sub connection of a driver's, used for change notices."""

    async def subscribe(self, channel: str) -> None: ...

    async def unsubscribe(self, channel: str) -> None: ...

    async def next_channel(self) -> str | None:
        """The channel of the next published message; ``None`` when none came for a while."""
        ...

    async def aclose(self) -> None: ...


class RedisDriver(Protocol):
    """The commands the store sends, through one client library."""

    #: The library's failures, turned into ``StoreError``; ``timeouts`` among them become
    #: ``StoreTimeoutError``.
    errors: tuple[type[BaseException], ...]
    timeouts: tuple[type[BaseException], ...]
    #: How long (seconds) after Redis answered a later command on another connection the
    #: client may still send or resend a command whose caller was cancelled or timed out:
    #: glide's request timeout, as its connection outlives the call and it retries after a
    #: reconnect or a script reload; 0 on redis-py, which closes the connection (a command
    #: Redis already received still runs, but no later than such an answer).
    late_command_window: float

    @property
    def batch(self) -> CommandBatch | None:
        """Sends together the commands made in one turn after its first; ``None`` where the
        client library does that itself (glide's one multiplexed connection) or cannot (a
        cluster, whose pipelines split by node)."""
        ...

    @property
    def set_command(self) -> Callable[..., Awaitable[Any]]:
        """Called ``(key, value, *words)``, it sends ``SET key value *words`` and resolves to
        the reply as Redis sent it: with ``GET``, the value the key held (``None`` when it
        wrote); without, ``OK`` or ``None``."""
        ...

    def get(self, key: str) -> Awaitable[bytes | str | None]: ...

    @property
    def scripts(self) -> Mapping[str, ScriptCall]:
        """The scripts of :data:`SCRIPTS` by name (their source is :func:`lua_source`), each
        loaded when the server does not know it (first use, restart, ``SCRIPT FLUSH``)."""
        ...

    def eval_script(self, name: str, key: str, args: list[Arg]) -> Awaitable[Any]:
        """Run the script sent whole (``EVAL``): slower, but never answered ``NOSCRIPT`` and
        so never resent behind commands queued after it."""
        ...

    def rejects_nx_get(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a server refusing ``SET NX GET`` (Redis < 7: a syntax error)."""
        ...

    def subscription(self) -> Subscription:
        """A new, unconnected pub/sub connection (it connects on its first subscribe)."""
        ...

    def describe(self) -> str:
        """Where the client points, without credentials: ``redis at 127.0.0.1:6379/0``, or
        ``redis cluster at`` a startup node."""
        ...

    async def ping(self) -> None:
        """``PING`` the server (every primary of a cluster)."""
        ...

    async def config_get(self, parameter: str) -> dict[str, str]:
        """``CONFIG GET parameter`` on the server (every primary of a cluster): node address
        -> value, ``""`` for a parameter the server does not know."""
        ...

    async def aclose(self) -> None:
        """Close the client."""
        ...


@runtime_checkable
class ReplicaWaitingDriver(RedisDriver, Protocol):
    """A driver that can pipeline ``WAIT`` behind a write on the write's own connection."""

    async def set_nx_and_wait(
        self, key: str, value: bytes, px: int, *, get: bool, replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """``SET NX PX`` (with ``GET`` when asked), then ``WAIT``: both replies."""
        ...

    async def run_script_and_wait(
        self, name: str, key: str, args: list[Arg], *, replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """The script, then ``WAIT``: both replies."""
        ...


@runtime_checkable
class ScanningDriver(RedisDriver, Protocol):
    """A driver that can walk the keys of a prefix, for operators (``list``): redis-py's."""

    def scan_values(
        self, match: str, count: int
    ) -> AsyncIterator[tuple[float, list[tuple[str, bytes | None]]]]:
        """The keys matching ``match`` with their values, a ``SCAN`` page at a time, each page
        with the server's time (seconds) read before it."""
        ...
