"""Redis store: one JSON value per key, acquired with one atomic command, fenced by Lua.

Each record lives under ``<key_prefix>:<key>`` as its JSON wire form (:func:`dump_record`),
with the lock TTL or the retention TTL as the Redis TTL. Acquiring is one atomic round trip
(``SET NX PX GET`` or a Lua script); every later write is a Lua compare-and-set on the owner
token. Standalone Redis and Redis Cluster both work: each operation touches a single key.

The commands go through a driver (:mod:`._driver`): redis-py or valkey-glide, picked by
the client passed in (or ``from_url(..., driver=...)``).

Recovery points: a record with checkpoints carries its lease inside its value (``lockedUntil``,
in epoch milliseconds of the Redis server's clock, ``TIME``). Every script that sets it or
judges it reads that clock, so pods whose clocks disagree still agree on whose lease ran out. A
conflict on such a record takes a second, rare step (``recover.lua``), which decides on the
server whether its lease has run out and takes it over in the same step when it may.

Why one module: an acquire's strategies (``SET NX GET``, the Lua script, the takeover of a dead
handler's record) and what undoes them when their caller gave up on a stalled server are one
protocol, correct only together with the fenced writes that follow them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import replace
from typing import Any, Literal

from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
    dump_record,
    load_record,
)
from starlette_idempotency.errors import ConfigurationError, StoreError, StoreTimeoutError
from starlette_idempotency.stores._lazy_pool import close_at_loop_end, refuse_a_busy_loop
from starlette_idempotency.stores._round_trip import (
    IN_ROUND_TRIP,
    ROUND_TRIP_TIMEOUT_SECONDS,
    RoundTrip,
)
from starlette_idempotency.stores.base import (
    DEFAULT_KEY_PREFIX,
    TAKING_BACK,
    AcquireResult,
    FencedWrite,
    HeldRecord,
    StoreBase,
    StoreFinding,
)
from starlette_idempotency.stores.redis._changes import RedisChangeListener
from starlette_idempotency.stores.redis._check import check_redis
from starlette_idempotency.stores.redis._driver import (
    Arg,
    RedisDriver,
    ReplicaWaitingDriver,
    ScanningDriver,
)

logger = logging.getLogger(__name__)

AcquireStrategy = Literal["setnx", "lua"]
DriverName = Literal["redis-py", "glide"]
DEFAULT_WAIT_TIMEOUT_MS = 100
_UNDO_RETRY_SECONDS = 0.1
# What SCAN's MATCH reads as a pattern, escaped in a key prefix; and the keys it asks for per
# page (a hint to the server).
_GLOB_SPECIAL = re.compile(r"[*?\[\]\\]")
_SCAN_COUNT = 500


def _driver_for(client: object) -> RedisDriver:
    """The driver for a redis-py or valkey-glide client (each imported only when installed)."""
    try:
        from starlette_idempotency.stores.redis._redis_py import RedisPyDriver, is_redis_py_client
    except ImportError:
        pass
    else:
        if is_redis_py_client(client):
            return RedisPyDriver(client)
    try:
        from starlette_idempotency.stores.redis._glide import GlideDriver, is_glide_client
    except ImportError:
        pass
    else:
        if is_glide_client(client):
            return GlideDriver(client)
    raise ConfigurationError(
        f"RedisStore needs a redis.asyncio client (Redis or RedisCluster) or a valkey-glide "
        f"client (GlideClient or GlideClusterClient), not {type(client).__name__}"
    )


@functools.lru_cache(maxsize=64)
def _ms(seconds: float) -> int:
    """A TTL as Redis takes it: whole milliseconds, at least 1 (it refuses ``PX 0``). A store
    is given few TTLs (each route's lock and retention), each converted once."""
    return max(1, round(seconds * 1000))


def _text(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply


class RedisStore(StoreBase):
    """Idempotency records in Redis (standalone or Cluster), shared by every process using it.

    ``client`` is a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster`` (redis-py), or a
    ``glide.GlideClient`` or ``glide.GlideClusterClient`` (valkey-glide, the ``glide`` extra);
    a client passed in is never closed by :meth:`aclose` (use :meth:`from_url` to let the
    store own one).

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
    unless fewer than ``N`` replicas are connected. The finishing write (the stored response)
    is ``WAIT``-ed for the same way, before the client gets the response's last byte, so a
    failover right after the response does not lose the record. ``wait_replicas`` needs
    redis-py: on valkey-glide's one multiplexed connection a ``WAIT`` would hold up every other
    caller.
    """

    name = "redis"
    supports_recovery = True

    def __init__(
        self,
        client: object,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        acquire: AcquireStrategy = "setnx",
        wait_replicas: int = 0,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        self._init(
            _driver_for(client),
            key_prefix=key_prefix,
            acquire=acquire,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
            owns_client=False,
        )

    def _init(
        self,
        driver: RedisDriver,
        *,
        key_prefix: str,
        acquire: AcquireStrategy,
        wait_replicas: int,
        wait_timeout_ms: int,
        owns_client: bool,
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
        self._waiting: ReplicaWaitingDriver | None = None
        if wait_replicas:
            if not isinstance(driver, ReplicaWaitingDriver):
                raise ConfigurationError(
                    "wait_replicas needs a redis-py client: WAIT on valkey-glide's one "
                    "multiplexed connection would hold up every other caller's commands"
                )
            self._waiting = driver
        self._driver = driver
        self._prefix = f"{key_prefix}:"
        # Apart from the records (a scan of the prefix finds records only).
        self._claims_prefix = f"{key_prefix}-operations:"
        self._acquire_strategy = acquire
        self._wait_replicas = wait_replicas
        self._wait_timeout_ms = wait_timeout_ms
        self._owns_client = owns_client
        # The event loop the operations run in, and for a client of the store's own what
        # closes its connections when that loop ends (see _enter_loop).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_end: AsyncGenerator[None, None] | None = None
        self._nx_get = True  # cleared for good once the server rejects SET NX GET
        self._acquire = self._acquire_command()
        self._changes = RedisChangeListener(driver.subscription)
        self._undoing: set[asyncio.Task[None]] = set()
        #: What the driver raises, turned into StoreError (timeouts into StoreTimeoutError).
        self._failures = (*driver.errors, *driver.timeouts)
        # What abandons a write that Redis may still run (see _undo_abandoned).
        self._abandoning_errors: tuple[type[BaseException], ...] = (
            asyncio.CancelledError,
            *driver.timeouts,
        )
        self._round_trip = RoundTrip(
            self,
            "Allow the store's Redis user, on a primary, the commands it sends (GET, SET, "
            "EVALSHA, SCRIPT LOAD, PUBLISH, SUBSCRIBE: ACL categories +@read +@write "
            f"+@scripting +@pubsub) on the keys and channels {key_prefix}* (the records "
            f"under {self._prefix}, the operation claims under {self._claims_prefix})",
            ROUND_TRIP_TIMEOUT_SECONDS,
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        acquire: AcquireStrategy = "setnx",
        wait_replicas: int = 0,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
        driver: DriverName = "redis-py",
        **client_options: Any,
    ) -> RedisStore:
        """A store with a client of its own for ``url``, closed by :meth:`aclose`.

        Nothing connects here, so the store can be built at import time: the client connects
        on first use, in the running event loop (with the middleware, at its startup check),
        and the middleware closes it when the app's lifespan ends. Used again after that, it
        connects again (a test client that starts the app again, in a new event loop).

        ``driver="redis-py"`` (the ``redis`` extra): ``client_options`` go to
        ``redis.asyncio.from_url`` (timeouts, retry, pool size); ``max_connections`` defaults
        to 1000 rather than redis-py's 100, past which a burst of concurrent requests would
        fail with "Too many connections".

        ``driver="glide"`` (the ``glide`` extra): a valkey-glide ``GlideClient``, created on
        first use; ``url`` is ``redis://[[user]:password@]host[:port][/db]`` (``rediss://``
        for TLS) and ``client_options`` go to ``glide.GlideClientConfiguration``
        (``request_timeout`` in milliseconds, ``client_name``, ...).
        """
        made: RedisDriver
        if driver == "redis-py":
            from starlette_idempotency.stores.redis._redis_py import RedisPyDriver, connect

            made = RedisPyDriver(connect(url, **client_options))
        elif driver == "glide":
            from starlette_idempotency.stores.redis._glide import GlideDriver, config_from_url

            made = GlideDriver(config_from_url(url, **client_options))
        else:
            raise ConfigurationError(f"driver must be 'redis-py' or 'glide', not {driver!r}")
        store = cls.__new__(cls)
        store._init(
            made,
            key_prefix=key_prefix,
            acquire=acquire,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
            owns_client=True,
        )
        return store

    @property
    def batches_calls(self) -> bool:
        """Whether the acquires and finishes made in one turn of the event loop after its
        first go to Redis in one pipeline (see ``CallBatchingStore``): on redis-py, but not
        on a cluster, with the ``lua`` acquire or with ``wait_replicas``."""
        return (
            self._driver.batch is not None
            and self._waiting is None
            and self._acquire_strategy == "setnx"
        )

    @property
    def owns_connections(self) -> bool:
        """Whether the store created its client itself (:meth:`from_url`): the middleware then
        closes it when the app's lifespan ends."""
        return self._owns_client

    def reopen(self) -> None:
        """Nothing to do: a client the store created connects again on its next command
        after :meth:`aclose` (the middleware calls this when the app starts again)."""

    def describe(self) -> str:
        """Where the store is, for messages: ``redis at 127.0.0.1:6379/0`` (no password)."""
        return self._driver.describe()

    async def check(self) -> list[StoreFinding]:
        """Reach Redis and report what weakens idempotency; never raises.

        An ``error`` when Redis does not answer ``PING``. Warnings, read with ``CONFIG GET``
        from the server or every primary of a cluster: a ``maxmemory`` with a policy that
        evicts (records vanish, and retries run again), and no append-only file (a restart
        loses records). When ``CONFIG`` is refused (renamed or not allowed, as on many
        managed services), one warning says what to check by hand. Raises
        :class:`ConfigurationError`, as an operation does, while a client of the store's own
        is open in another event loop that still runs.
        """
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        where = self.describe()
        findings = await check_redis(self._driver, where)
        if any(finding.level == "error" for finding in findings):
            return findings
        refused = await self._round_trip.finding(where)
        return findings if refused is None else [refused, *findings]

    def _failed(self, operation: str, key: str, exc: BaseException) -> StoreError:
        """The driver's failure ``exc`` as the store's. The next check does what a request
        does again: a Redis that failed a request (a primary demoted to a replica, an ACL
        tightened, memory full under ``noeviction``) is not ready until it works again."""
        self._round_trip.failed(operation)
        if isinstance(exc, self._driver.timeouts):
            return StoreTimeoutError(f"redis {operation} timed out for key {key!r}")
        return StoreError(f"redis {operation} failed for key {key!r}: {exc}")

    async def _enter_loop(self) -> None:
        """Called by the first operation in an event loop (an identity check per operation).

        A client the store created (:meth:`from_url`) connects in the loop that uses it, and
        its connections serve no other; so it is closed when that loop ends, if the app's
        lifespan did not close it first, and connects again in the next loop. Starlette's
        ``TestClient`` outside a ``with`` block runs no lifespan and each request in a loop of
        its own. A client passed in is the app's: used as it is, in whatever loop runs.
        """
        loop = asyncio.get_running_loop()
        if self._owns_client and self._loop is not None:  # its connections are open there
            name = f"RedisStore's client ({self.describe()})"
            refuse_a_busy_loop(name, self._loop, still_open=True)
        self._loop = loop
        if self._owns_client:
            self._loop_end = await close_at_loop_end(
                functools.partial(self._close_at_loop_end, loop)
            )

    async def _close_at_loop_end(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:  # not closed by aclose() meanwhile
            self._loop_end = None
            await self.aclose()

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
        acquired. A conflict on an ``InProgress`` record with recovery points asks the server
        whether its lease has run out (``lease_expired``) and, with ``recover``, takes it over
        when its fingerprint and version equal ``pending``'s (see the module docs): it keeps
        its checkpoints and TTL, gets ``pending``'s owner token and a lease of ``lock_ttl``, and
        comes back as ``record``. An ``InProgress`` record that already has ``pending``'s owner
        token counts as acquired (``record`` is it if it has checkpoints).

        A call cancelled or timed out after sending is undone in the background (see
        :meth:`_undo_abandoned`): the caller will not run the handler, so the lock must not
        outlive it.
        """
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        skey, value = self._prefix + key, dump_record(pending)
        px = _ms(lock_ttl)
        try:
            for _ in range(3):  # the key can vanish between the acquire and the recovery step
                try:
                    try:
                        existing = await self._acquire(skey, value, px)
                    except Exception as exc:
                        if not self._fall_back_from_nx_get(exc):
                            raise
                        existing = await self._acquire_set_then_get(skey, value, px)
                except self._abandoning_errors:
                    self._undo_abandoned(key, pending.owner_token, lock_ttl)
                    raise
                if existing is None:
                    return AcquireResult(acquired=True)
                current = self._load(key, existing)
                if (
                    current.owner_token == pending.owner_token
                    and current.status is RecordStatus.IN_PROGRESS
                ):
                    # Our own write (an acquire, or a takeover keeping its checkpoints),
                    # answered as a conflict: the client resent a command whose reply was
                    # lost (redis-py's retry, glide after a reconnect); or the owner taking
                    # back a key it still holds.
                    taken_over = current if current.checkpoints else None
                    return AcquireResult(acquired=True, record=taken_over)
                if current.status is not RecordStatus.IN_PROGRESS or current.locked_until is None:
                    # A final record, or a lock its TTL holds: no lease for the server to judge.
                    return AcquireResult(acquired=False, record=current, lease_expired=False)
                try:
                    reply = await self._recover(skey, pending, px, recover)
                except self._abandoning_errors:
                    # Its lease ended rather than the key freed: that keeps the checkpoints.
                    self._undo_abandoned(key, pending.owner_token, lock_ttl)
                    raise
                if not reply:
                    continue  # the key vanished meanwhile: acquire it afresh
                taken, holder, expired = reply
                if taken:
                    return AcquireResult(acquired=True, record=self._load(key, holder))
                return AcquireResult(
                    acquired=False, record=self._load(key, holder), lease_expired=bool(expired)
                )
        except self._failures as exc:
            raise self._failed("try_acquire", key, exc) from exc
        raise StoreError(f"key {key!r} kept vanishing between its acquire and its recovery")

    def _undo_abandoned(self, key: str, owner_token: str, lock_ttl: float) -> None:
        """Undo an acquire (or takeover) whose caller gave up: cancelled by a deadline or a
        client gone, or timed out; the caller will not run the handler.

        Redis may still run the write and hold the key for ``lock_ttl``, answering retries
        409: on a stall (a slow command, a fork, a frozen host) the command waits in Redis's
        socket buffer, and Redis runs it when it wakes even though redis-py closed the
        connection; glide keeps its connection and may even resend the command after a
        reconnect. ``abandon.lua`` undoes it, fenced by the abandoned write's own owner token
        (deleting the key, or ending the lease of a record with recovery points), and changes
        nothing when the write did not land; see :meth:`_undo_twice`. A write that went in a
        batch is undone once the batches in flight have ended: until then one may still send
        it (opening its connection, or redis-py's retry sending its pipeline again).
        """
        if TAKING_BACK.get() == owner_token:  # its handler runs (see stores.base.take_back)
            return
        args: list[Arg] = [owner_token, self._prefix + key]
        loop = asyncio.get_running_loop()
        batch = self._driver.batch
        sending = () if batch is None else batch.in_flight(loop)
        task = loop.create_task(self._undo_twice(key, args, lock_ttl, sending))
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _undo_twice(
        self,
        key: str,
        args: list[Arg],
        lock_ttl: float,
        sending: tuple[asyncio.Task[None], ...],
    ) -> None:
        # The first undo may run before the abandoned write: Redis serves the connections
        # that became readable during a stall in one event-loop iteration, in no set order
        # (glide queues it behind the write on their shared connection instead). Its reply
        # comes back only after that iteration, so a second undo sent then runs after any
        # write Redis had received; glide may resend a write after a reconnect up to its
        # late_command_window later still. Sent whole (EVAL): a NOSCRIPT answer would have
        # the client resend it behind later commands.
        skey = self._prefix + key
        failure: StoreError | None = None

        async def undo() -> None:
            nonlocal failure
            while True:
                try:
                    try:
                        await self._driver.eval_script("abandon", skey, args)
                    except self._failures as exc:
                        raise self._failed("undo (abandon)", key, exc) from exc
                    return
                except StoreError as exc:  # a stall longer than the client's own timeout
                    failure = exc
                    await asyncio.sleep(_UNDO_RETRY_SECONDS)

        unanswered = "Redis did not answer the undo"
        waited_for = "the batch that sent it was still in flight"
        try:
            async with asyncio.timeout(lock_ttl):  # by then the abandoned lock has lapsed
                if sending:
                    await asyncio.wait(sending)
                waited_for = unanswered
                await undo()
                waited_for = "the client's window for a late resend of it outlasted the lock"
                await asyncio.sleep(self._driver.late_command_window)
                waited_for = unanswered
                await undo()
        except TimeoutError:
            logger.warning(
                "could not undo the abandoned acquire of %r before its lock lapsed: %s",
                key,
                failure or waited_for,
            )

    def _acquire_command(self) -> Callable[[str, bytes, int], Awaitable[Any]]:
        """What :meth:`try_acquire` sends, ``(skey, value, px)``: it resolves to ``None`` when
        ``value`` was written, else to the value holding ``skey``.

        Chosen with the strategy, not per call: the driver's own call where it can be, so no
        frame of ours waits on it. A server that rejects ``SET NX GET`` raises, and
        ``try_acquire`` hands the error to :meth:`_fall_back_from_nx_get`.
        """
        if self._waiting is not None:
            return functools.partial(self._acquire_and_wait, self._waiting)
        if self._acquire_strategy == "lua":
            return self._acquire_by_script
        if self._nx_get:
            return self._set_nx_get
        return self._acquire_set_then_get

    def _set_nx_get(self, skey: str, value: bytes, px: int) -> Awaitable[Any]:
        args = (skey, value, "PX", str(px), "NX", "GET")
        batch = self._driver.batch
        if batch is not None:
            # A turn's first command goes out at once; those after it in the same turn go out
            # together at its end (see PipelinedCommands). The loop clears the mark, no call
            # of ours: a function shared with finish() would be one more per store call.
            loop = asyncio.get_running_loop()
            turn = batch.turn
            if turn and turn[0] is loop:
                return batch.set(args, loop)
            turn[:] = (loop,)
            loop.call_soon(turn.clear)
        return self._driver.set_command(*args)

    def _acquire_by_script(self, skey: str, value: bytes, px: int) -> Awaitable[Any]:
        return self._driver.scripts["acquire"]([skey], [value, str(px)])

    def _fall_back_from_nx_get(self, exc: BaseException) -> bool:
        """True when ``exc`` is the server rejecting ``SET NX GET``: from then on, for good,
        the store acquires with ``SET NX`` then ``GET`` (a call sent before that, answered
        after it, falls back too)."""
        if self._acquire_strategy != "setnx" or not self._driver.rejects_nx_get(exc):
            return False
        if not self._nx_get:
            return True
        self._nx_get = False
        self._acquire = self._acquire_command()
        logger.info("Redis rejected SET NX GET (%s); acquiring with SET NX, then GET", exc)
        return True

    async def _acquire_set_then_get(self, skey: str, value: bytes, px: int) -> Any:
        # Two round trips for Redis < 7. The key may expire between them: then try once more.
        for _ in range(2):
            if await self._driver.set_command(skey, value, "PX", str(px), "NX") is not None:
                return None
            existing = await self._driver.get(skey)
            if existing is not None:
                return existing
        raise StoreError(f"key {skey!r} kept expiring between SET NX and GET")

    async def _acquire_and_wait(
        self, waiting: ReplicaWaitingDriver, skey: str, value: bytes, px: int
    ) -> Any:
        # Retries: the SET NX GET fallback, a key lapsing between SET NX and GET.
        replicas, timeout_ms = self._replica_wait()
        for _ in range(3):
            if self._acquire_strategy == "lua":
                reply, acknowledged = await waiting.run_script_and_wait(
                    "acquire", skey, [value, str(px)], replicas=replicas, timeout_ms=timeout_ms
                )
            else:
                nx_get = self._nx_get
                try:
                    reply, acknowledged = await waiting.set_nx_and_wait(
                        skey, value, px, get=nx_get, replicas=replicas, timeout_ms=timeout_ms
                    )
                except Exception as exc:
                    if self._fall_back_from_nx_get(exc):
                        continue
                    raise
                if not nx_get:  # SET NX answers whether it wrote; read the holder if not
                    if reply:
                        reply = None
                    else:
                        reply = await self._driver.get(skey)
                        if reply is None:
                            continue
                        return reply
            if reply is None:
                self._check_replicas(skey, acknowledged, replicas, "the lock")
            return reply
        raise StoreError(f"key {skey!r} kept expiring between SET NX and GET")

    async def _recover(self, skey: str, pending: IdempotencyRecord, px: int, recover: bool) -> Any:
        """``recover.lua``'s reply: ``[]`` when the key is absent, else ``[taken, value,
        lease_expired]`` (the lease judged, and the record taken over, on the server)."""
        args: list[Arg] = [pending.request_fingerprint, pending.fingerprint_version]
        args += [pending.owner_token, str(px), "1" if recover else "0"]
        if self._waiting is None:
            return await self._driver.scripts["recover"]([skey], args)
        replicas, timeout_ms = self._replica_wait()
        reply, acknowledged = await self._waiting.run_script_and_wait(
            "recover", skey, args, replicas=replicas, timeout_ms=timeout_ms
        )
        if reply and reply[0]:
            self._check_replicas(skey, acknowledged, replicas, "the lock")
        return reply

    def _replica_wait(self) -> tuple[int, int]:
        """How many replicas a write waits for, and how long: none for the check's round trip,
        which asks whether the store may write, not whether its replicas keep up."""
        if IN_ROUND_TRIP.get():
            return 0, 0
        return self._wait_replicas, self._wait_timeout_ms

    def _check_replicas(self, skey: str, acknowledged: int, replicas: int, what: str) -> None:
        if acknowledged < replicas:
            logger.warning(
                "%d of %d Redis replicas acknowledged %s on %r within %d ms",
                acknowledged,
                replicas,
                what,
                skey,
                self._wait_timeout_ms,
            )

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        """Store the final record for ``ttl`` seconds unless another owner holds the key
        (``LOST``); ``RECLAIMED`` when the key had vanished (evicted, deleted, lock expired).

        Made in a turn of the loop after another command, it goes out at the turn's end with
        the others, in one pipeline (see ``PipelinedCommands``); the fencing is the script's.
        With ``wait_replicas``, ``WAIT`` is pipelined behind it, as behind the acquire: the
        response is not sent whole before the replicas have the record (or the wait timed out,
        which is logged)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            await self._enter_loop()
        skey = self._prefix + key
        px = _ms(ttl)
        args: list[Arg] = [dump_record(record), record.owner_token, str(px), skey]
        batch = self._driver.batch
        try:
            if self._waiting is None:
                if batch is not None and batch.turn and batch.turn[0] is loop:  # as _set_nx_get
                    written = await batch.script("finish", skey, args, loop)
                else:
                    if batch is not None:
                        batch.turn[:] = (loop,)
                        loop.call_soon(batch.turn.clear)
                    written = await self._driver.scripts["finish"]([skey], args)
            else:
                replicas, timeout_ms = self._replica_wait()
                written, acknowledged = await self._waiting.run_script_and_wait(
                    "finish", skey, args, replicas=replicas, timeout_ms=timeout_ms
                )
                if written:
                    self._check_replicas(skey, acknowledged, replicas, "the response")
        except self._failures as exc:
            raise self._failed("finish", key, exc) from exc
        return FencedWrite(int(written))

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        """Replace the owner's ``InProgress`` record (its checkpoints) for ``ttl`` seconds, with
        a lease of ``lease`` seconds on the server's clock.

        False, writing nothing, unless ``record.owner_token`` holds the key ``InProgress``.
        """
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        value = dump_record(replace(record, locked_until=0.0))  # the script sets the lease
        px = _ms(ttl)
        args: list[Arg] = [value, record.owner_token, str(px), str(round(lease * 1000))]
        try:
            saved = await self._driver.scripts["progress"]([self._prefix + key], args)
        except self._failures as exc:
            raise self._failed("save_progress", key, exc) from exc
        return bool(saved)

    async def release(self, key: str, owner_token: str) -> bool:
        """Delete the key if ``owner_token`` holds it; false when another owner does."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        skey = self._prefix + key
        try:
            released = await self._driver.scripts["release"]([skey], [owner_token, skey])
        except self._failures as exc:
            raise self._failed("release", key, exc) from exc
        return bool(released)

    async def renew(
        self, key: str, owner_token: str, lock_ttl: float, *, ttl: float | None = None
    ) -> bool:
        """Extend the lock to ``lock_ttl`` if ``owner_token`` holds it ``InProgress``: the key's
        TTL, or for a record with recovery points its lease, on the server's clock, the key's
        TTL then running at least to the lease's end (or ``ttl`` from now, when given). A
        ``lock_ttl`` of ``0`` ends such a lease now (``renew.lua`` keeps a bare lock 1 ms)."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        args: list[Arg] = [owner_token, str(max(0, round(lock_ttl * 1000)))]
        if ttl is not None:
            args.append(str(_ms(ttl)))
        try:
            renewed = await self._driver.scripts["renew"]([self._prefix + key], args)
        except self._failures as exc:
            raise self._failed("renew", key, exc) from exc
        return bool(renewed)

    async def claim_operation(
        self, operation: str, code: str, holder: str, ttl: float
    ) -> str | None:
        """Claim ``operation`` for ``holder`` (see ``OperationClaimingStore``): a hash of
        holders under ``<key_prefix>-operations:<operation>``, each claim's expiry on the
        server's clock."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        skey = self._claims_prefix + operation
        px = _ms(ttl)
        try:
            other = await self._driver.scripts["claim"]([skey], [holder, code, str(px)])
        except self._failures as exc:
            raise self._failed("claim_operation", operation, exc) from exc
        return None if other is None else _text(other)

    async def release_operation(self, operation: str, holder: str) -> None:
        """End ``holder``'s claim on ``operation``."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        skey = self._claims_prefix + operation
        try:
            await self._driver.scripts["unclaim"]([skey], [holder])
        except self._failures as exc:
            raise self._failed("release_operation", operation, exc) from exc

    async def wait_for_change(self, key: str) -> None:
        """Return once ``key`` is completed, failed, released or resolved by any process
        (bounded by the caller): a pub/sub notice on the channel named after the key."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        try:
            await self._changes.wait(self._prefix + key)
        except self._failures as exc:
            raise self._failed("wait_for_change", key, exc) from exc

    async def get(self, key: str) -> IdempotencyRecord | None:
        """The live record under ``key``, if any."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        try:
            raw = await self._driver.get(self._prefix + key)
        except self._failures as exc:
            raise self._failed("get", key, exc) from exc
        return None if raw is None else self._load(key, raw)

    async def in_progress(self, *, stuck: bool = False, limit: int = 1000) -> list[HeldRecord]:
        """Live ``InProgress`` records under the store's prefix, oldest first, at most ``limit``
        (for operators: ``starlette-idempotency list``; read-only). With ``stuck``, only those
        whose lease ran out (:attr:`HeldRecord.lease_expired`), judged on the server's clock.

        Walks every key of the prefix with ``SCAN`` (which never blocks the server) and reads
        each value: a cost in proportion to the keys stored, for an operator's shell. Needs a
        redis-py client on a standalone Redis."""
        if asyncio.get_running_loop() is not self._loop:
            await self._enter_loop()
        driver = self._driver
        if not isinstance(driver, ScanningDriver):
            raise ConfigurationError("listing records needs a redis-py client")
        match = _GLOB_SPECIAL.sub(r"\\\g<0>", self._prefix) + "*"
        found: list[HeldRecord] = []
        try:
            async for now, page in driver.scan_values(match, _SCAN_COUNT):
                for skey, raw in page:
                    if raw is None:
                        continue
                    key = skey[len(self._prefix) :]
                    record = self._load(key, raw)
                    if record.status is not RecordStatus.IN_PROGRESS:
                        continue
                    expired = record.lease_expired(now)
                    if expired or not stuck:
                        found.append(HeldRecord(key, record, expired))
        except self._failures as exc:
            raise self._failed("in_progress", match, exc) from exc
        found.sort(key=lambda held: held.record.created_at)
        return found[:limit]

    async def aclose(self) -> None:
        """Close the change listener, and the client if :meth:`from_url` created it; a client
        passed in stays open."""
        loop_end, self._loop_end, self._loop = self._loop_end, None, None
        if loop_end is not None:
            await loop_end.aclose()  # this loop's end has nothing left to close
        undoing = list(self._undoing)  # undoing abandoned acquires is best effort
        for task in undoing:
            task.cancel()
        await asyncio.gather(*undoing, return_exceptions=True)
        await self._changes.aclose()
        if not self._owns_client:
            return
        try:
            await self._driver.aclose()
        except self._driver.errors as exc:
            raise StoreError(f"closing the redis client failed: {exc}") from exc
