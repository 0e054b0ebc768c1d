"""The valkey-glide driver of :class:`~starlette_idempotency.stores.redis.RedisStore`.

valkey-glide keeps one multiplexed connection per node, driven by a Rust core on its own
threads that pipelines the commands of concurrent callers automatically. Two consequences:

- ``WAIT`` is not offered (``wait_replicas`` needs redis-py): on a multiplexed connection it
  would block every caller's commands behind it, and it would count everyone's writes.
- A call the middleware cancels leaves no connection half-read (glide's core owns the
  connection and drops the late reply), but the command may still run on the server, even
  resent after a reconnect or a script reload within glide's ``request_timeout``: the store
  undoes such a late acquire with a fenced release, sent at once (queued behind the acquire
  on the same connection) and again once ``request_timeout`` has passed.

A store built by ``RedisStore.from_url(..., driver="glide")`` creates its client on first use,
on the event loop that serves requests (glide clients belong to the loop that created them).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeAlias, TypeGuard, TypeVar, cast
from urllib.parse import unquote, urlsplit

from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.stores._lazy_pool import retrieve_exception
from starlette_idempotency.stores.redis._driver import SCRIPTS, Arg, ScriptCall, lua_source

try:
    from glide import (
        AllPrimaries,
        GlideClient,
        GlideClientConfiguration,
        GlideClusterClient,
        GlideClusterClientConfiguration,
        GlideError,
        NodeAddress,
        RequestError,
        Script,
        ServerCredentials,
        TGlideClient,
    )
    from glide import TimeoutError as GlideTimeoutError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "RedisStore on valkey-glide needs it installed: pip install 'starlette-idempotency[glide]'"
    ) from exc

ClientConfiguration: TypeAlias = GlideClientConfiguration | GlideClusterClientConfiguration
P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT_MS = 5000
GLIDE_REQUEST_TIMEOUT_MS = 250  # glide's own default
_SCHEMES = {"redis": False, "valkey": False, "rediss": True, "valkeys": True}


def is_glide_client(client: object) -> TypeGuard[TGlideClient]:
    """Whether ``client`` is a valkey-glide asyncio client (standalone or cluster)."""
    return isinstance(client, GlideClient | GlideClusterClient)


def config_from_url(url: str, **client_options: Any) -> GlideClientConfiguration:
    """A standalone client configuration for ``redis://[[user]:password@]host[:port][/db]``
    (``rediss://`` for TLS); ``client_options`` go to ``GlideClientConfiguration``.

    ``request_timeout`` defaults to 5000 ms rather than glide's 250: the middleware bounds
    each store call with its own ``store_timeout_seconds``, and a burst of requests queued
    in the client must not fail on glide's shorter clock first.
    """
    client_options.setdefault("request_timeout", DEFAULT_REQUEST_TIMEOUT_MS)
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ConfigurationError(
            f"valkey-glide needs a redis://, rediss://, valkey:// or valkeys:// URL, not {url!r}"
        )
    if parts.query:
        raise ConfigurationError(
            f"pass valkey-glide options as keyword arguments, not in the URL query: {url!r}"
        )
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigurationError(f"the database in {url!r} must be a number")
    credentials = None
    if parts.password is not None:
        credentials = ServerCredentials(
            password=unquote(parts.password),
            username=unquote(parts.username) if parts.username else None,
        )
    return GlideClientConfiguration(
        [NodeAddress(parts.hostname or "localhost", parts.port or 6379)],
        use_tls=_SCHEMES[parts.scheme],
        credentials=credentials,
        database_id=int(db) if db else None,
        **client_options,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GlideSubscription:
    """A client of its own for pub/sub, made from the command client's configuration, so the
    change notices never take messages a user's own subscriptions on that client wait for."""

    def __init__(self, driver: GlideDriver) -> None:
        self._driver = driver
        self._client: TGlideClient | None = None
        self._connecting = asyncio.Lock()  # concurrent first subscribes make one client

    async def _connected(self) -> TGlideClient:
        if self._client is None:
            async with self._connecting:
                if self._client is None:
                    commands = await self._driver.connected()
                    self._client = await type(commands).create(commands.config)
        return self._client

    async def subscribe(self, channel: str) -> None:
        await (await self._connected()).subscribe({channel})

    async def unsubscribe(self, channel: str) -> None:
        await (await self._connected()).unsubscribe({channel})

    async def next_channel(self) -> str | None:
        message = await (await self._connected()).get_pubsub_message()
        channel = message.channel
        return channel.decode() if isinstance(channel, bytes) else channel

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


class GlideDriver:
    """Commands through a ``glide.GlideClient`` or ``GlideClusterClient``, given or created
    from a configuration on first use."""

    errors: tuple[type[BaseException], ...] = (GlideError, OSError)
    timeouts: tuple[type[BaseException], ...] = (GlideTimeoutError, TimeoutError)
    #: glide pipelines the commands of all its callers on its one connection itself.
    batch = None

    def __init__(self, client: TGlideClient | ClientConfiguration) -> None:
        self._client: TGlideClient | None
        self._config: ClientConfiguration | None
        if isinstance(client, ClientConfiguration):
            self._client, self._config, config = None, client, client
        else:
            self._client, self._config, config = client, None, client.config
        self.late_command_window = (config.request_timeout or GLIDE_REQUEST_TIMEOUT_MS) / 1000
        self._connecting: asyncio.Task[TGlideClient] | None = None
        self.scripts: dict[str, ScriptCall] = {
            name: functools.partial(self._invoke_script, Script(lua_source(name)))  # type: ignore[no-untyped-call]
            for name in SCRIPTS
        }

    async def connected(self) -> TGlideClient:
        """The client, created on the first call when the driver was given a configuration.

        Concurrent first calls share one creation; after a failed one, the next call starts
        another.
        """
        if self._client is not None:
            return self._client
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._create())
            self._connecting.add_done_callback(retrieve_exception)
        # Shielded: a first caller cut short by its deadline leaves the creation to others.
        return await asyncio.shield(self._connecting)

    async def _create(self) -> TGlideClient:
        config = cast(ClientConfiguration, self._config)
        client_class = (
            GlideClusterClient
            if isinstance(config, GlideClusterClientConfiguration)
            else GlideClient
        )
        self._client = await client_class.create(config)
        return self._client

    async def _after_connecting(
        self, command: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        await self.connected()
        return await command(*args, **kwargs)

    def set_command(self, key: str, value: bytes, *words: str) -> Awaitable[Any]:
        client = self._client
        if client is None:
            return self._after_connecting(self.set_command, key, value, *words)
        # Sent as it is: glide routes it by its key, and hands back the reply as it came.
        return client.custom_command(["SET", key, value, *words])

    def get(self, key: str) -> Awaitable[bytes | str | None]:
        client = self._client
        if client is None:
            return self._after_connecting(self.get, key)
        return client.get(key)

    def _invoke_script(self, script: Script, keys: list[str], args: list[Arg]) -> Awaitable[Any]:
        # glide sends EVALSHA and loads the script itself when the server does not know it.
        client = self._client
        if client is None:
            return self._after_connecting(self._invoke_script, script, keys, args)
        return client.invoke_script(script, keys=keys, args=args)

    async def eval_script(self, name: str, key: str, args: list[Arg]) -> Any:
        client = await self.connected()
        return await client.custom_command(["EVAL", lua_source(name), "1", key, *args])

    def rejects_nx_get(self, exc: BaseException) -> bool:
        return isinstance(exc, RequestError) and "syntax error" in str(exc).lower()

    def subscription(self) -> GlideSubscription:
        return GlideSubscription(self)

    def _configuration(self) -> ClientConfiguration:
        if self._config is not None:
            return self._config
        return cast(TGlideClient, self._client).config

    def _first_node(self) -> str:
        first = self._configuration().addresses[0]
        return f"{first.host}:{first.port}"

    def describe(self) -> str:
        config = self._configuration()
        if isinstance(config, GlideClusterClientConfiguration):
            return f"redis cluster at {self._first_node()}"
        return f"redis at {self._first_node()}/{config.database_id or 0}"

    async def ping(self) -> None:
        await (await self.connected()).ping()  # a cluster client pings every primary

    async def config_get(self, parameter: str) -> dict[str, str]:
        client = await self.connected()
        replies: dict[Any, Any]
        if isinstance(client, GlideClusterClient):
            replies = cast(dict[Any, Any], await client.config_get([parameter], AllPrimaries()))
        else:
            replies = {self._first_node(): await client.config_get([parameter])}
        return {
            _text(node): _text(values.get(parameter.encode(), b""))
            for node, values in replies.items()
        }

    async def aclose(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        client, self._client = self._client, None
        if client is not None:
            await client.close()
