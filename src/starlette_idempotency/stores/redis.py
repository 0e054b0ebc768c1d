"""Redis store: one JSON value per key, acquired with one atomic command, fenced by Lua.

Each record lives under ``<key_prefix>:<key>`` as its JSON wire form (:func:`dump_record`),
with the lock TTL or the retention TTL as the Redis TTL. Acquiring is one atomic round trip
(``SET NX PX GET`` or a Lua script); every later write is a Lua compare-and-set on the owner
token. Standalone Redis and Redis Cluster both work: each operation touches a single key.

Recovery points: a conflict on an ``InProgress`` record whose lease (``lockedUntil``, inside the
value) has passed and whose fingerprint matches is taken over with a second, rare step, a
compare-and-set on the whole value the acquire returned (``takeover.lua``). Leases are
judged on this process's wall clock, as the middleware sets them: keep app servers on NTP.

Cancellation: redis-py 8 closes a connection when a command on it is cancelled between send and
reply (``Connection.send_packed_command`` / ``read_response`` catch ``BaseException`` and
disconnect), so a call cut short by the middleware's ``asyncio.timeout`` returns no half-read
connection to the pool. This store never shields a call and lets ``CancelledError`` through.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, Protocol

from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError
from starlette_idempotency.record import (
    IdempotencyRecord,
    StoredResponse,
    dump_record,
    load_record,
)
from starlette_idempotency.stores.base import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_RESOLVED_TTL,
    AcquireResult,
    resolve_record,
)
from starlette_idempotency.stores.redis_changes import RedisChangeListener

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "RedisStore needs the redis driver: pip install 'starlette-idempotency[redis]'"
    ) from exc

logger = logging.getLogger(__name__)

AcquireStrategy = Literal["setnx", "lua"]
DEFAULT_WAIT_TIMEOUT_MS = 100

_DRIVER_ERRORS = (redis_errors.RedisError, redis_errors.RedisClusterException, OSError)


class _DriverErrors:
    """Turns the driver's errors inside ``with`` into StoreError (a class: on the hot path a
    generator-based context manager costs several times more)."""

    __slots__ = ("_key", "_operation")

    def __init__(self, operation: str, key: str) -> None:
        self._operation = operation
        self._key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, redis_errors.TimeoutError | TimeoutError):
            raise StoreTimeoutError(
                f"redis {self._operation} timed out for key {self._key!r}"
            ) from exc
        if isinstance(exc, _DRIVER_ERRORS):
            raise StoreError(
                f"redis {self._operation} failed for key {self._key!r}: {exc}"
            ) from exc


class RedisScript(Protocol):
    """What ``register_script`` returns (redis-py ``AsyncScript``)."""

    sha: str

    async def __call__(
        self, keys: Sequence[Any] | None = None, args: Sequence[Any] | None = None
    ) -> Any: ...


class RedisClient(Protocol):
    """The methods of ``redis.asyncio.Redis`` / ``RedisCluster`` this store uses."""

    def set(self, name: Any, value: Any, *args: Any, **kwargs: Any) -> Any: ...
    def get(self, name: Any) -> Any: ...
    def pipeline(self, *args: Any, **kwargs: Any) -> Any: ...
    def register_script(self, script: Any) -> Any: ...
    def script_load(self, script: Any) -> Any: ...
    async def aclose(self) -> None: ...


_NEEDS_RECORD_PRELUDE = frozenset({"finish", "release", "renew"})


@functools.cache
def _lua(name: str) -> str:
    """A script's source; those that read the stored record get ``_record.lua`` first."""
    lua = importlib.resources.files("starlette_idempotency.stores").joinpath("lua")
    source = lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in _NEEDS_RECORD_PRELUDE:
        source = lua.joinpath("_record.lua").read_text(encoding="utf-8") + source
    return source


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _recoverable(current: IdempotencyRecord, pending: IdempotencyRecord, now: float) -> bool:
    """Whether ``pending``'s request may take ``current`` over: a checkpointed handler died."""
    return (
        current.lease_expired(now)
        and current.request_fingerprint == pending.request_fingerprint
        and current.fingerprint_version == pending.fingerprint_version
    )


class RedisStore:
    """Idempotency records in Redis (standalone or Cluster), shared by every process using it.

    ``client`` is a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``; a client passed
    in is never closed by :meth:`aclose` (use :meth:`from_url` to let the store own one).

    ``acquire`` picks how :meth:`try_acquire` writes: ``"setnx"`` sends ``SET NX PX GET``
    (Redis >= 7; on older servers the store falls back, once per instance, to ``SET NX PX``
    then ``GET``), ``"lua"`` runs a script that reads and writes in one step.

    Replication is asynchronous: a failover right after an acquire can promote a replica that
    never saw the lock, and a retry then runs the request a second time. ``wait_replicas=N``
    narrows that window: ``WAIT N wait_timeout_ms`` is pipelined behind the acquire on the
    same connection (``WAIT`` only counts its own connection's writes), so it costs no extra
    round trip. When fewer than ``N`` replicas acknowledge in time the lock is still held and
    a warning is logged: ``WAIT`` is not a consensus protocol, and a failing request would not
    make the lock any safer. On a conflict nothing is written and ``WAIT`` returns at once
    unless fewer than ``N`` replicas are connected.
    """

    name = "redis"
    supports_recovery = True

    def __init__(
        self,
        client: RedisClient,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        acquire: AcquireStrategy = "setnx",
        wait_replicas: int = 0,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        if "{" in key_prefix or "}" in key_prefix:
            raise ConfigurationError(
                f"key_prefix {key_prefix!r} must not contain '{{' or '}}' (Redis Cluster hash tag)"
            )
        if acquire not in ("setnx", "lua"):
            raise ConfigurationError(f"acquire must be 'setnx' or 'lua', not {acquire!r}")
        if wait_replicas < 0:
            raise ConfigurationError(f"wait_replicas must be >= 0, not {wait_replicas!r}")
        if wait_replicas and wait_timeout_ms <= 0:
            # WAIT with a timeout of 0 blocks forever.
            raise ConfigurationError(f"wait_timeout_ms must be > 0, not {wait_timeout_ms!r}")
        self._client = client
        self._prefix = f"{key_prefix}:"
        self._acquire_strategy = acquire
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._owns_client = False
        self._nx_get = True  # cleared for good once the server rejects SET NX GET
        self._acquire_script: RedisScript = client.register_script(_lua("acquire"))
        self._finish_script: RedisScript = client.register_script(_lua("finish"))
        self._release_script: RedisScript = client.register_script(_lua("release"))
        self._renew_script: RedisScript = client.register_script(_lua("renew"))
        self._takeover_script: RedisScript = client.register_script(_lua("takeover"))
        self._changes = RedisChangeListener(client)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        acquire: AcquireStrategy = "setnx",
        wait_replicas: int = 0,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
        **client_options: Any,
    ) -> RedisStore:
        """A store with its own ``redis.asyncio.Redis`` client, closed by :meth:`aclose`.

        ``client_options`` go to ``redis.asyncio.from_url`` (timeouts, retry, pool size).
        ``max_connections`` defaults to 1000 rather than redis-py's 100, past which a burst
        of concurrent requests would fail with "Too many connections"; redis-py's
        ``BlockingConnectionPool``, which waits instead, costs about a fifth more CPU per call.
        """
        client_options.setdefault("max_connections", 1000)
        client: RedisClient = aioredis.from_url(url, **client_options)
        store = cls(
            client,
            key_prefix=key_prefix,
            acquire=acquire,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
        )
        store._owns_client = True
        return store

    def storage_key(self, key: str) -> str:
        """The Redis key that holds ``key``'s record."""
        return self._prefix + key

    @staticmethod
    def _load(key: str, raw: bytes | str) -> IdempotencyRecord:
        try:
            return load_record(raw)
        except ValueError as exc:
            raise StoreError(f"redis holds a malformed record for key {key!r}") from exc

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        """Write ``pending`` for ``lock_ttl`` seconds if the key is free, in one atomic step.

        An expired record is gone from Redis, so ``record`` is ``None`` when a free key was
        acquired. With ``recover``, an ``InProgress`` record whose lease has passed and whose
        fingerprint and version equal ``pending``'s is taken over (see the module docs): it
        keeps its checkpoints and TTL, gets ``pending``'s owner token and a lease of
        ``lock_ttl``, and comes back as ``record``.
        """
        skey, value, px = self.storage_key(key), dump_record(pending), _ms(lock_ttl)
        with _DriverErrors("try_acquire", key):
            for _ in range(3):  # a takeover lost to another contender reads the key again
                try:
                    existing = await self._acquire(skey, value, px)
                except redis_errors.ResponseError as exc:
                    if not self._fall_back_from_nx_get(exc):
                        raise
                    existing = await self._acquire_set_then_get(skey, value, px)
                if existing is None:
                    return AcquireResult(acquired=True)
                current = self._load(key, existing)
                now = time.time()
                if not (recover and _recoverable(current, pending, now)):
                    break
                taken = replace(
                    current, owner_token=pending.owner_token, locked_until=now + lock_ttl
                )
                if await self._take_over(skey, existing, dump_record(taken)):
                    return AcquireResult(acquired=True, record=current)
        return AcquireResult(acquired=False, record=current)

    def _acquire(self, skey: str, value: bytes, px: int) -> Awaitable[Any]:
        """Resolves to ``None`` when ``value`` was written, else to the value holding ``skey``.

        Returns the client's own awaitable where it can, so no frame of ours waits on it; a
        server that rejects ``SET NX GET`` raises ``ResponseError``, which ``try_acquire``
        hands to :meth:`_fall_back_from_nx_get`.
        """
        if self._wait_replicas:
            return self._acquire_and_wait(skey, value, px)
        if self._acquire_strategy == "lua":
            return self._acquire_script(keys=[skey], args=[value, px])
        if self._nx_get:
            return self._client.set(skey, value, px=px, nx=True, get=True)  # type: ignore[no-any-return]
        return self._acquire_set_then_get(skey, value, px)

    def _fall_back_from_nx_get(self, exc: redis_errors.ResponseError) -> bool:
        """True (once, for good) when ``exc`` is the server rejecting ``SET NX GET``."""
        if self._acquire_strategy != "setnx" or not self._nx_get:
            return False
        if "syntax error" not in str(exc).lower():  # Redis < 7: "ERR syntax error"
            return False
        self._nx_get = False
        logger.info("Redis rejected SET NX GET (%s); acquiring with SET NX, then GET", exc)
        return True

    async def _acquire_set_then_get(self, skey: str, value: bytes, px: int) -> Any:
        # Two round trips for Redis < 7. The key may expire between them: then try once more.
        for _ in range(2):
            if await self._client.set(skey, value, px=px, nx=True):
                return None
            existing = await self._client.get(skey)
            if existing is not None:
                return existing
        raise StoreError(f"key {skey!r} kept expiring between SET NX and GET")

    async def _acquire_and_wait(self, skey: str, value: bytes, px: int) -> Any:
        # Retries: the SET NX GET fallback, a key lapsing between SET NX and GET.
        for _ in range(3):
            if self._acquire_strategy == "lua":
                reply, replicas = await self._eval_and_wait(
                    skey, self._acquire_script, "acquire", value, px
                )
            else:
                nx_get = self._nx_get
                try:
                    reply, replicas = await self._set_and_wait(skey, value, px, get=nx_get)
                except redis_errors.ResponseError as exc:
                    if self._fall_back_from_nx_get(exc):
                        continue
                    raise
                if not nx_get:  # SET NX answers whether it wrote; read the holder if not
                    if reply:
                        reply = None
                    else:
                        reply = await self._client.get(skey)
                        if reply is None:
                            continue
                        return reply
            if reply is None:
                self._check_replicas(skey, replicas)
            return reply
        raise StoreError(f"key {skey!r} kept expiring between SET NX and GET")

    async def _take_over(self, skey: str, expected: bytes | str, value: bytes) -> bool:
        if not self._wait_replicas:
            return bool(await self._takeover_script(keys=[skey], args=[expected, value]))
        reply, replicas = await self._eval_and_wait(
            skey, self._takeover_script, "takeover", expected, value
        )
        if reply:
            self._check_replicas(skey, replicas)
        return bool(reply)

    async def _with_wait(self, skey: str, queue: Callable[[Any], object]) -> tuple[Any, int]:
        """Pipeline the command ``queue`` adds and ``WAIT`` behind it on the same connection
        (``WAIT`` counts only its own connection's writes); the command's reply and ``WAIT``'s."""
        pipe = self._client.pipeline(transaction=False)
        queue(pipe)
        pipe.wait(self._wait_replicas, self._wait_timeout_ms, **await self._wait_target(skey))
        reply, replicas = await pipe.execute()
        return reply, int(replicas)

    async def _set_and_wait(
        self, skey: str, value: bytes, px: int, *, get: bool
    ) -> tuple[Any, int]:
        return await self._with_wait(
            skey, lambda pipe: pipe.set(skey, value, px=px, nx=True, get=get)
        )

    async def _eval_and_wait(
        self, skey: str, script: RedisScript, name: str, *args: Any
    ) -> tuple[Any, int]:
        def queue(pipe: Any) -> None:
            # EVALSHA by name: ClusterPipeline blocks only its evalsha() helper.
            pipe.execute_command("EVALSHA", script.sha, 1, skey, *args)

        try:
            return await self._with_wait(skey, queue)
        except redis_errors.NoScriptError:  # the server lost it (restart, SCRIPT FLUSH)
            await self._client.script_load(_lua(name))
            return await self._with_wait(skey, queue)

    def _check_replicas(self, skey: str, replicas: int) -> None:
        if replicas < self._wait_replicas:
            logger.warning(
                "%d of %d Redis replicas acknowledged the lock on %r within %d ms",
                replicas,
                self._wait_replicas,
                skey,
                self._wait_timeout_ms,
            )

    async def _wait_target(self, skey: str) -> dict[str, Any]:
        # WAIT counts the writes of its own connection: in a cluster pipeline, send it to the
        # node that owns the key so it shares that node's connection with the acquire.
        if not isinstance(self._client, aioredis.RedisCluster):
            return {}
        await self._client.initialize()  # the slot map (a no-op once loaded)
        return {"target_nodes": self._client.get_node_from_key(skey)}

    async def _write_if_owner(
        self, operation: str, key: str, record: IdempotencyRecord, ttl: float, *, absent_ok: bool
    ) -> bool:
        # A final record wakes waiting duplicates; new recovery points or a lease do not.
        skey = self.storage_key(key)
        channel = skey if absent_ok else ""
        with _DriverErrors(operation, key):
            written = await self._finish_script(
                keys=[skey],
                args=[dump_record(record), record.owner_token, _ms(ttl), int(absent_ok), channel],
            )
        return bool(written)

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Store the ``Completed`` record for ``ttl`` seconds unless another owner holds the key."""
        return await self._write_if_owner("complete", key, record, ttl, absent_ok=True)

    async def fail(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Store the ``Failed`` record for ``ttl`` seconds unless another owner holds the key."""
        return await self._write_if_owner("fail", key, record, ttl, absent_ok=True)

    async def save_progress(self, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Replace the owner's ``InProgress`` record (checkpoints, lease) for ``ttl`` seconds.

        False, writing nothing, unless ``record.owner_token`` holds the key.
        """
        return await self._write_if_owner("save_progress", key, record, ttl, absent_ok=False)

    async def resolve(
        self, key: str, response: StoredResponse, ttl: float = DEFAULT_RESOLVED_TTL
    ) -> bool:
        """Finish the record under ``key`` with ``response``, whoever holds it (operators)."""
        return await resolve_record(self, key, response, ttl)

    async def release(self, key: str, owner_token: str) -> bool:
        """Delete the key if ``owner_token`` holds it; false when another owner does."""
        skey = self.storage_key(key)
        with _DriverErrors("release", key):
            released = await self._release_script(keys=[skey], args=[owner_token, skey])
        return bool(released)

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        """Reset the lock TTL to ``lock_ttl`` if ``owner_token`` holds it ``InProgress``."""
        with _DriverErrors("renew", key):
            renewed = await self._renew_script(
                keys=[self.storage_key(key)], args=[owner_token, _ms(lock_ttl)]
            )
        return bool(renewed)

    async def wait_for_change(self, key: str) -> None:
        """Return once ``key`` is completed, failed, released or resolved by any process
        (bounded by the caller): a pub/sub notice on the channel named after the key."""
        with _DriverErrors("wait_for_change", key):
            await self._changes.wait(self.storage_key(key))

    async def get(self, key: str) -> IdempotencyRecord | None:
        """The live record under ``key``, if any."""
        with _DriverErrors("get", key):
            raw = await self._client.get(self.storage_key(key))
        return None if raw is None else self._load(key, raw)

    async def aclose(self) -> None:
        """Close the change listener, and the client if :meth:`from_url` created it; a client
        passed in stays open."""
        await self._changes.aclose()
        if not self._owns_client:
            return
        try:
            await self._client.aclose()
        except _DRIVER_ERRORS as exc:
            raise StoreError(f"closing the redis client failed: {exc}") from exc
