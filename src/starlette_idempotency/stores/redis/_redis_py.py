"""The redis-py driver of :class:`~starlette_idempotency.stores.redis.RedisStore`.

Cancellation: redis-py 8 closes a connection when a command on it is cancelled between send and
reply (``Connection.send_packed_command`` / ``read_response`` catch ``BaseException`` and
disconnect), so a call cut short by the middleware's deadline returns no half-read connection
to the pool. Nothing here shields a call; ``CancelledError`` goes through. Closing does not
take back a command Redis has received: one waiting in its socket buffer while Redis stalls
still runs when it wakes (the store undoes an abandoned acquire).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeGuard

from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.stores.redis._driver import SCRIPTS, Arg, lua_source

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "RedisStore on redis-py needs the redis driver: pip install 'starlette-idempotency[redis]'"
    ) from exc

_READ_TIMEOUT_SECONDS = 1.0


class RedisScript(Protocol):
    """What ``register_script`` returns (redis-py ``AsyncScript``)."""

    sha: str

    async def __call__(
        self, keys: Sequence[Any] | None = None, args: Sequence[Any] | None = None
    ) -> Any: ...


class RedisClient(Protocol):
    """The methods of ``redis.asyncio.Redis`` / ``RedisCluster`` the driver uses."""

    def set(self, name: Any, value: Any, *args: Any, **kwargs: Any) -> Any: ...
    def execute_command(self, *args: Any, **options: Any) -> Any: ...
    def get(self, name: Any) -> Any: ...
    def pipeline(self, *args: Any, **kwargs: Any) -> Any: ...
    def pubsub(self, **kwargs: Any) -> Any: ...
    def register_script(self, script: Any) -> Any: ...
    def eval(self, script: Any, numkeys: int, *keys_and_args: Any) -> Any: ...
    def script_load(self, script: Any) -> Any: ...
    def ping(self, **kwargs: Any) -> Any: ...
    def config_get(self, pattern: str = "*", **kwargs: Any) -> Any: ...
    def scan(self, cursor: int = 0, match: Any = None, count: Any = None, **kwargs: Any) -> Any: ...
    def mget(self, keys: Any, *args: Any) -> Any: ...
    def time(self, **kwargs: Any) -> Any: ...
    async def aclose(self) -> None: ...


def is_redis_py_client(client: object) -> TypeGuard[RedisClient]:
    """Whether ``client`` is a ``redis.asyncio`` client (standalone or Cluster)."""
    return isinstance(client, aioredis.Redis | aioredis.RedisCluster)


def connect(url: str, **client_options: Any) -> RedisClient:
    """A ``redis.asyncio`` client for ``url`` (it connects on first use).

    ``max_connections`` defaults to 1000 rather than redis-py's 100, past which a burst of
    concurrent requests would fail with "Too many connections"; redis-py's
    ``BlockingConnectionPool``, which waits instead, costs about a fifth more CPU per call.

    ``socket_timeout`` defaults to none (redis-py's is 5 s; its connect timeout stays): the
    middleware bounds every call itself (``store_timeout_seconds``), and on Python 3.11
    redis-py's own timeout runs each command's write in a task of its own (``wait_for``) and
    its read under a timeout object, so every command would leave a task, futures and timer
    handles for the collector and suspend its caller twice.
    """
    client_options.setdefault("max_connections", 1000)
    client_options.setdefault("socket_timeout", None)
    client: RedisClient = aioredis.from_url(url, **client_options)
    return client


#: A command waiting for its turn's end: its words, the options redis-py's reply callbacks
#: read, and the future its caller awaits.
_Queued = tuple[tuple[Arg | int, ...], dict[str, Any], "asyncio.Future[Any]"]
#: ``SET`` with ``GET``: the reply as it came, rather than a bool.
_SET_OPTIONS: dict[str, Any] = {"get": True}
_NO_OPTIONS: dict[str, Any] = {}


class _GivenUp:
    """Cancels the batch in flight once each of its callers has given up (its deadline
    passed, its client left), whatever it waits for (its pipeline, a script's load): redis-py
    then closes the connection, as it does for a command cancelled alone, rather than wait on a
    stalled server, or a dead peer, for ever. Taken off a caller's reply before the batch
    answers it."""

    __slots__ = ("_commands", "_task")

    def __init__(self, commands: list[_Queued]) -> None:
        self._commands = commands
        self._task = asyncio.current_task()

    def __call__(self, _: asyncio.Future[Any]) -> None:
        if self._task is not None and all(reply.done() for _, _, reply in self._commands):
            self._task.cancel()


class PipelinedCommands:
    """The commands made in one turn of the event loop after its first (acquires' ``SET``,
    finishes' script), sent in one pipeline once the turn has ended: one write, and one
    wake-up of Redis, for them all.

    Sent one by one, each found Redis asleep, having answered the one before, and woke it; a
    wake-up costs the worker's ``write()`` an interrupt to another core and Redis a turn of
    its loop, more than the command itself (docs/explanation/benchmarks.md#pipelined-sets).
    The store sends a turn's first command at once, so a request alone keeps its latency.

    A caller cancelled before its batch goes out is left out of it, and its command never
    reaches Redis; one cancelled after is undone by the store, as a command sent alone, once
    the batch has ended (:meth:`in_flight`): until then the batch may still send it, its
    connection being opened or redis-py's retry sending the pipeline again. A batch that fails
    (a connection lost) fails each of its callers with the error. A script the server answers
    ``NOSCRIPT`` (restarted, or ``SCRIPT FLUSH``) did not run: it is loaded and its calls sent
    again, as redis-py's own script call does.
    """

    __slots__ = ("_batch", "_client", "_loop", "_scripts", "_sending", "_sources", "turn")

    def __init__(self, client: RedisClient, scripts: dict[str, RedisScript]) -> None:
        self._client = client
        self._scripts = scripts
        self._sources = {script.sha: lua_source(name) for name, script in scripts.items()}
        self.turn: list[asyncio.AbstractEventLoop] = []
        #: The commands waiting for the turn's end, and the loop they were made in.
        self._batch: list[_Queued] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def set(self, args: tuple[Arg, ...], loop: asyncio.AbstractEventLoop) -> Awaitable[Any]:
        return self._add(("SET", *args), _SET_OPTIONS, loop)

    def script(
        self, name: str, key: str, args: list[Arg], loop: asyncio.AbstractEventLoop
    ) -> Awaitable[Any]:
        return self._add(("EVALSHA", self._scripts[name].sha, 1, key, *args), _NO_OPTIONS, loop)

    def _add(
        self,
        command: tuple[Arg | int, ...],
        options: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
    ) -> Awaitable[Any]:
        reply: asyncio.Future[Any] = loop.create_future()
        if not self._batch or self._loop is not loop:
            self._batch, self._loop = [], loop
            # Its first step runs once this turn's callers have all made their calls.
            task = loop.create_task(self._send(self._batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._batch.append((command, options, reply))
        return reply

    def in_flight(self, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Task[None], ...]:
        return tuple(task for task in self._sending if task.get_loop() is loop)

    async def _send(self, batch: list[_Queued]) -> None:
        if self._batch is batch:
            self._batch = []
        given_up = _GivenUp(batch)
        for _, _, reply in batch:
            reply.add_done_callback(given_up)
        try:
            unknown = await self._execute(batch, given_up)
            if unknown:
                for sha in {command[1] for command, _, _ in unknown}:
                    await self._client.script_load(self._sources[str(sha)])
                for _, _, reply in await self._execute(unknown, given_up):
                    reply.remove_done_callback(given_up)
                    reply.set_exception(redis_errors.NoScriptError("script lost again on load"))
        except Exception as exc:
            for _, _, reply in batch:
                if not reply.done():
                    reply.remove_done_callback(given_up)
                    reply.set_exception(exc)
        finally:
            for _, _, reply in batch:  # the loop shutting down: nobody will answer them
                if not reply.done():
                    reply.remove_done_callback(given_up)
                    reply.cancel()

    async def _execute(self, commands: list[_Queued], given_up: _GivenUp) -> list[_Queued]:
        """Send ``commands`` (those whose callers still wait) in one pipeline and answer their
        callers; the scripts the server did not know come back unanswered."""
        commands = [queued for queued in commands if not queued[2].done()]
        if not commands:
            return []
        pipe = self._client.pipeline(transaction=False)
        for command, options, _ in commands:
            pipe.execute_command(*command, **options)
        replies = await pipe.execute(raise_on_error=False)
        unknown = []
        for queued, answer in zip(commands, replies, strict=True):
            reply = queued[2]
            if reply.done():
                continue
            if isinstance(answer, redis_errors.NoScriptError):
                unknown.append(queued)
                continue
            reply.remove_done_callback(given_up)
            if isinstance(answer, Exception):
                reply.set_exception(answer)
            else:
                reply.set_result(answer)
        return unknown


class RedisPySubscription:
    """A redis-py ``PubSub`` connection."""

    def __init__(self, client: RedisClient) -> None:
        self._pubsub: Any = client.pubsub()

    async def subscribe(self, channel: str) -> None:
        await self._pubsub.subscribe(channel)

    async def unsubscribe(self, channel: str) -> None:
        await self._pubsub.unsubscribe(channel)

    async def next_channel(self) -> str | None:
        message = await self._pubsub.get_message(
            ignore_subscribe_messages=True, timeout=_READ_TIMEOUT_SECONDS
        )
        if message is None or message.get("type") != "message":
            return None
        channel = message["channel"]
        return channel.decode() if isinstance(channel, bytes) else str(channel)

    async def aclose(self) -> None:
        await self._pubsub.aclose()


class RedisPyDriver:
    """Commands through a ``redis.asyncio.Redis`` or ``RedisCluster`` client."""

    errors: tuple[type[BaseException], ...] = (
        redis_errors.RedisError,
        redis_errors.RedisClusterException,
        OSError,
    )
    timeouts: tuple[type[BaseException], ...] = (redis_errors.TimeoutError, TimeoutError)
    late_command_window = 0.0

    def __init__(self, client: RedisClient) -> None:
        self._client = client
        # The command itself rather than client.set(): set() checks and assembles its options
        # on every call (about 20 µs of a replay's CPU in redis-py 8). get=True has the reply
        # callback hand back the reply as it came rather than a bool.
        self.set_command: Callable[..., Awaitable[Any]] = functools.partial(
            client.execute_command, "SET", get=True
        )
        # redis-py's AsyncScript sends EVALSHA and reloads the script on NoScriptError.
        self.scripts: dict[str, RedisScript] = {
            name: client.register_script(lua_source(name)) for name in SCRIPTS
        }
        #: None on a cluster: its pipelines split commands by node, and retry them apart.
        self.batch: PipelinedCommands | None = (
            None
            if isinstance(client, aioredis.RedisCluster)
            else PipelinedCommands(client, self.scripts)
        )

    def get(self, key: str) -> Awaitable[bytes | str | None]:
        return self._client.get(key)  # type: ignore[no-any-return]

    def eval_script(self, name: str, key: str, args: list[Arg]) -> Awaitable[Any]:
        return self._client.eval(lua_source(name), 1, key, *args)  # type: ignore[no-any-return]

    def rejects_nx_get(self, exc: BaseException) -> bool:
        return isinstance(exc, redis_errors.ResponseError) and "syntax error" in str(exc).lower()

    async def set_nx_and_wait(
        self, key: str, value: bytes, px: int, *, get: bool, replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        return await self._with_wait(
            key, lambda pipe: pipe.set(key, value, px=px, nx=True, get=get), replicas, timeout_ms
        )

    async def run_script_and_wait(
        self, name: str, key: str, args: list[Arg], *, replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        script = self.scripts[name]

        def queue(pipe: Any) -> None:
            # EVALSHA by name: ClusterPipeline blocks only its evalsha() helper.
            pipe.execute_command("EVALSHA", script.sha, 1, key, *args)

        try:
            return await self._with_wait(key, queue, replicas, timeout_ms)
        except redis_errors.NoScriptError:  # the server lost it (restart, SCRIPT FLUSH)
            await self._client.script_load(lua_source(name))
            return await self._with_wait(key, queue, replicas, timeout_ms)

    async def _with_wait(
        self, key: str, queue: Callable[[Any], object], replicas: int, timeout_ms: int
    ) -> tuple[Any, int]:
        """Pipeline the command ``queue`` adds and ``WAIT`` behind it on the same connection
        (``WAIT`` counts only its own connection's writes); the command's reply and ``WAIT``'s."""
        pipe = self._client.pipeline(transaction=False)
        queue(pipe)
        pipe.wait(replicas, timeout_ms, **await self._wait_target(key))
        reply, acknowledged = await pipe.execute()
        return reply, int(acknowledged)

    async def _wait_target(self, key: str) -> dict[str, Any]:
        # In a cluster pipeline, send WAIT to the node that owns the key so it shares that
        # node's connection with the write.
        if not isinstance(self._client, aioredis.RedisCluster):
            return {}
        await self._client.initialize()  # the slot map (a no-op once loaded)
        return {"target_nodes": self._client.get_node_from_key(key)}

    def subscription(self) -> RedisPySubscription:
        return RedisPySubscription(self._client)

    def _standalone_address(self) -> tuple[str, int]:
        """The server a standalone client connects to, and its database number."""
        options: dict[str, Any] = self._client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        if "path" in options:
            return f"unix:{options['path']}", options.get("db", 0)
        return f"{options.get('host', 'localhost')}:{options.get('port', 6379)}", options.get(
            "db", 0
        )

    def describe(self) -> str:
        client = self._client
        if isinstance(client, aioredis.RedisCluster):
            startup = next(iter(client.nodes_manager.startup_nodes.values()))
            return f"redis cluster at {startup.name}"
        address, db = self._standalone_address()
        return f"redis at {address}/{db}"

    async def ping(self) -> None:
        await self._client.ping()

    async def config_get(self, parameter: str) -> dict[str, str]:
        client = self._client
        replies: dict[str, Any] = {}
        if isinstance(client, aioredis.RedisCluster):
            await client.initialize()
            for primary in client.get_primaries():
                replies[primary.name] = await client.config_get(parameter, target_nodes=primary)
        else:
            replies[self._standalone_address()[0]] = await client.config_get(parameter)
        return {node: str(reply.get(parameter, "")) for node, reply in replies.items()}

    async def scan_values(
        self, match: str, count: int
    ) -> AsyncIterator[tuple[float, list[tuple[str, bytes | None]]]]:
        """The keys matching ``match`` with their values (``None`` for a key deleted since),
        a ``SCAN`` page of about ``count`` at a time, with the server's ``TIME`` (seconds)
        read before the page. Standalone Redis only."""
        client = self._client
        if isinstance(client, aioredis.RedisCluster):
            raise ConfigurationError(
                "listing records is not supported on a Redis Cluster: run it per primary "
                "with a standalone URL of each"
            )
        cursor = -1
        while cursor != 0:
            seconds, micros = await client.time()
            cursor, keys = await client.scan(max(cursor, 0), match=match, count=count)
            if keys:
                values = await client.mget(keys)
                names = [key.decode() if isinstance(key, bytes) else key for key in keys]
                yield seconds + micros / 1_000_000, list(zip(names, values, strict=True))

    async def aclose(self) -> None:
        await self._client.aclose()
