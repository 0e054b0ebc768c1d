"""Store round trips per request, counted by the servers, and the size of a stored record.

Redis: a ``MONITOR`` connection on the private server sees every command; commands a client
sent are round trips, commands a Lua script ran (``[0 lua]``) are not. ``INFO commandstats``
deltas give the same mix from the server's counters (scripts' inner commands included).
PostgreSQL: asyncpg's query logger on every pooled connection records each statement; the
pool's own reset query, run when a connection goes back to the pool, is counted apart.

Each case runs in-process (the same app as under uvicorn, called without a server) after one
warm-up request, so connection set-up and script loading are not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import re
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.app import AppSettings, AppState, build_app
from bench.asgi import Reply, call, running
from bench.configs import FLOOR_FOR, AppName
from bench.requests import REQUEST_BODIES

RENEWAL_LOCK_TTL = 1.5  # seconds; renewal starts at a third of it (0.5 s)
SHORT_HANDLER = 0.2  # < TTL / 3: must cost no renewal
LONG_HANDLER = 0.7  # > TTL / 3: one renewal
_LUA_CLIENT = re.compile(r"^\+?\d+\.\d+ \[\d+ lua\]")
_COMMAND = re.compile(r'\] "([^"]+)"')


@dataclass
class Count:
    """What one phase of one request cost the store."""

    round_trips: int = 0
    commands: Counter[str] = field(default_factory=Counter)  # incl. those inside scripts
    client_commands: Counter[str] = field(default_factory=Counter)
    extra: int = 0  # PostgreSQL: pool reset queries (round trips the store did not ask for)
    status: int = 0

    def describe(self) -> str:
        parts = [f"{name} {n}" for name, n in sorted(self.client_commands.items())]
        return ", ".join(parts) or "none"

    def describe_all(self) -> str:
        return ", ".join(f"{name} {n}" for name, n in sorted(self.commands.items())) or "none"


@dataclass
class ConfigCounts:
    config: str
    cases: dict[str, Count] = field(default_factory=dict)
    record_bytes: dict[str, int] = field(default_factory=dict)  # key -> MEMORY USAGE / row size
    value_bytes: dict[str, int] = field(default_factory=dict)  # key -> stored value length
    error: str | None = None


class RedisMonitor:
    """A ``MONITOR`` stream on one server, cut into phases by ``ECHO`` markers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RedisMonitor:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writer.write(b"*1\r\n$7\r\nMONITOR\r\n")
        await self._writer.drain()
        await self._reader.readline()  # +OK
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(OSError):
                await self._writer.wait_closed()

    async def _mark(self) -> str:
        marker = f"bench-marker-{uuid.uuid4().hex}"
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        data = marker.encode()
        writer.write(b"*2\r\n$4\r\nECHO\r\n$%d\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        await reader.readline()
        await reader.readline()
        writer.close()
        await writer.wait_closed()
        return marker

    async def _lines_until(self, marker: str) -> list[str]:
        assert self._reader is not None
        lines: list[str] = []
        while True:
            raw = await asyncio.wait_for(self._reader.readline(), timeout=10)
            line = raw.decode(errors="replace").rstrip("\r\n")
            if marker in line:
                return lines
            lines.append(line)

    @contextlib.asynccontextmanager
    async def phase(self, count: Count) -> AsyncIterator[None]:
        """Count the commands sent while the block runs into ``count``."""
        stats_before = await commandstats(self.port)
        await self._lines_until(await self._mark())
        yield
        lines = await self._lines_until(await self._mark())
        stats_after = await commandstats(self.port)
        for line in lines:
            match = _COMMAND.search(line)
            if match is None:
                continue
            name = match.group(1).upper()
            if _LUA_CLIENT.match(line):
                continue
            count.client_commands[name] += 1
            count.round_trips += 1
        for name, calls in stats_after.items():
            delta = calls - stats_before.get(name, 0)
            if delta > 0 and name not in ("info", "echo"):
                count.commands[name.upper()] += delta


async def commandstats(port: int) -> dict[str, int]:
    from starlette_idempotency.testing.redis_server import redis_command

    raw = await asyncio.to_thread(redis_command, port, "INFO", "commandstats")
    stats: dict[str, int] = {}
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("cmdstat_"):
            name, _, rest = line[len("cmdstat_") :].partition(":")
            fields = dict(item.split("=", 1) for item in rest.split(","))
            stats[name.split("|")[0]] = stats.get(name.split("|")[0], 0) + int(fields["calls"])
    return stats


Phase = Callable[[Count], contextlib.AbstractAsyncContextManager[None]]


async def _cases(
    app: Any, state: AppState, phase: Phase, tag: str, body: bytes
) -> dict[str, Count]:
    """First request (acquire, then complete), replay, conflict; warm-up excluded."""
    warm = f"{tag}-warm"
    for _ in range(2):
        await call(app, body=body, key=warm)
    cases: dict[str, Count] = {}
    key = f"{tag}-first"
    acquire, complete, replay, conflict = Count(), Count(), Count(), Count()
    state.entered, state.gate = asyncio.Event(), asyncio.Event()
    async with phase(acquire):
        first = asyncio.create_task(call(app, body=body, key=key))
        await asyncio.wait_for(state.entered.wait(), timeout=10)
    async with phase(complete):
        state.gate.set()
        reply: Reply = await first
    acquire.status = complete.status = reply.status
    state.entered = state.gate = None
    async with phase(replay):
        replay.status = (await call(app, body=body, key=key)).status
    state.entered, state.gate = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(call(app, body=body, key=f"{tag}-conflict"))
    await asyncio.wait_for(state.entered.wait(), timeout=10)
    async with phase(conflict):
        conflict.status = (await call(app, body=body, key=f"{tag}-conflict")).status
    state.gate.set()
    await holder
    state.entered = state.gate = None
    total = Count(
        round_trips=acquire.round_trips + complete.round_trips,
        commands=acquire.commands + complete.commands,
        client_commands=acquire.client_commands + complete.client_commands,
        extra=acquire.extra + complete.extra,
        status=reply.status,
    )
    cases.update(
        {
            "first: acquire": acquire,
            "first: complete": complete,
            "first request": total,
            "replay": replay,
            "conflict (409)": conflict,
        }
    )
    return cases


async def _renewal(
    app: Any, state: AppState, phase: Phase, tag: str, body: bytes
) -> dict[str, Count]:
    state.delay = LONG_HANDLER  # warm up the renewal path too (its script gets loaded)
    await call(app, body=body, key=f"{tag}-renew-warm")
    cases: dict[str, Count] = {}
    for label, delay in (("short", SHORT_HANDLER), ("long", LONG_HANDLER)):
        count = Count()
        state.delay = delay
        async with phase(count):
            count.status = (await call(app, body=body, key=f"{tag}-renew-{label}")).status
        state.delay = 0.0
        cases[f"handler {delay:g} s, lock TTL {RENEWAL_LOCK_TTL:g} s"] = count
    return cases


async def count_redis(
    config: str, redis_url: str, port: int, app_name: AppName = "plain"
) -> ConfigCounts:
    """Round trips of one Redis-backed configuration (private server only: MONITOR)."""
    import redis.asyncio as aioredis

    result = ConfigCounts(config)
    prefix = f"rt-{config}"
    tag = f"rt{uuid.uuid4().hex[:8]}"
    body = REQUEST_BODIES[app_name]
    async with RedisMonitor(port) as monitor:
        app, state = build_app(
            AppSettings(config=config, app=app_name, redis_url=redis_url, prefix=prefix)
        )
        async with running(app):
            result.cases.update(await _cases(app, state, monitor.phase, tag, body))
        if config.startswith("ours-redis"):
            app, state = build_app(
                AppSettings(
                    config=config,
                    app=app_name,
                    redis_url=redis_url,
                    prefix=f"{prefix}-renew",
                    lock_ttl_seconds=RENEWAL_LOCK_TTL,
                )
            )
            async with running(app):
                result.cases.update(await _renewal(app, state, monitor.phase, tag, body))
    client: Any = aioredis.from_url(redis_url)
    try:
        async for raw_key in client.scan_iter(match=f"{prefix}:*{tag}-first*"):
            name = raw_key.decode()
            usage = await client.memory_usage(raw_key, samples=0)
            result.record_bytes[name] = int(usage or 0)
            if (await client.type(raw_key)) == b"string":
                result.value_bytes[name] = int(await client.strlen(raw_key))
        if config == "aih-redis":  # one member per key in a set that never expires
            set_key = f"{prefix}:aih-keys"
            members = int(await client.scard(set_key)) or 1
            usage = int(await client.memory_usage(set_key, samples=0) or 0)
            result.record_bytes[f"{set_key} (share of 1 of {members} members)"] = usage // members
    finally:
        await client.aclose()
    return result


# --- PostgreSQL -------------------------------------------------------------------------


def _normalise(sql: str) -> str:
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return " ".join(" ".join(lines).split()).rstrip(";").strip()


def _named_queries(table: str) -> dict[str, str]:
    """The store's named queries (``queries.sql``), normalised, keyed by their text."""
    text = (
        importlib.resources.files("starlette_idempotency.stores")
        .joinpath("sql/queries.sql")
        .read_text(encoding="utf-8")
    )
    parts = re.split(r"^-- name: (\w+)\s*$", text, flags=re.MULTILINE)
    quoted = f'"{table}"'
    return {
        _normalise(body.replace("{table}", quoted)): name
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


class QueryLog:
    def __init__(self, table: str) -> None:
        self.records: list[str] = []
        self._names = _named_queries(table)

    async def init(self, connection: Any) -> None:
        connection.add_query_logger(lambda record: self.records.append(record.query))

    def name(self, query: str) -> str | None:
        """The named query, ``None`` for the pool's reset, else the query's first words."""
        normal = _normalise(query)
        if normal in self._names:
            return self._names[normal]
        if "pg_advisory_unlock_all" in normal:
            return None
        return normal[:40]

    @contextlib.asynccontextmanager
    async def phase(self, count: Count) -> AsyncIterator[None]:
        await asyncio.sleep(0.02)  # loggers run via call_soon: let earlier ones land
        self.records.clear()
        yield
        await asyncio.sleep(0.02)
        for query in self.records:
            name = self.name(query)
            if name is None:
                count.extra += 1
            else:
                count.client_commands[name] += 1
                count.commands[name] += 1
                count.round_trips += 1
        self.records.clear()


async def count_postgres(dsn: str, app_name: AppName = "plain") -> ConfigCounts:
    import asyncpg  # type: ignore[import-untyped]

    result = ConfigCounts("ours-postgres")
    table = "bench_roundtrips"
    log = QueryLog(table)
    tag = f"rt{uuid.uuid4().hex[:8]}"
    for lock_ttl, runner in ((None, _cases), (RENEWAL_LOCK_TTL, _renewal)):
        settings = AppSettings(
            config="ours-postgres",
            app=app_name,
            postgres_dsn=dsn,
            prefix="rt-ours-postgres",
            pg_table=table,
            lock_ttl_seconds=lock_ttl,
            pg_init=log.init,
        )
        app, state = build_app(settings)
        async with running(app):
            result.cases.update(await runner(app, state, log.phase, tag, REQUEST_BODIES[app_name]))
    connection: Any = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            f"SELECT key, pg_column_size(t.*) AS size, octet_length(response_body) AS body "
            f'FROM "{table}" t WHERE key LIKE $1',
            f"%{tag}-first",
        )
        for row in rows:
            result.record_bytes[row["key"]] = int(row["size"])
            result.value_bytes[row["key"]] = int(row["body"] or 0)
    finally:
        await connection.close()
    return result


async def count_all(
    configs: list[str],
    redis_url: str | None,
    redis_port: int | None,
    postgres_dsn: str | None,
    app_name: AppName = "plain",
) -> list[ConfigCounts]:
    results: list[ConfigCounts] = []
    for config in configs:
        job: Awaitable[ConfigCounts] | None = None
        if config == "ours-postgres" and postgres_dsn:
            job = count_postgres(postgres_dsn, app_name)
        elif redis_url and redis_port and config in _REDIS_COUNTED:
            job = count_redis(config, redis_url, redis_port, app_name)
        if job is None:
            continue
        try:
            results.append(await job)
        except Exception as exc:  # report it and go on with the others
            results.append(ConfigCounts(config, error=f"{type(exc).__name__}: {exc}"))
    return results


_REDIS_COUNTED = ("floor-redis", *FLOOR_FOR, "aih-redis", "mobius-redis")
