"""Below the floor: what a Redis client costs per command, and what a faster one would save.

``python -m bench.clients`` starts a private ``redis-server`` and, with 32 concurrent callers on
uvloop, times the floor's pair of commands (``SET NX PX GET``, then ``SET PX``) through:

- redis-py with its pure-Python RESP3 parser (what ``RedisStore`` and the floor use unless
  hiredis is installed);
- redis-py with the hiredis parser, when ``hiredis`` is installed;
- valkey-glide (a Rust core with automatic pipelining; the ``glide`` extra, in ``dev``).

hiredis comes from the ``clients`` dependency group: ``pip install -e . --group clients``.
It reports this process's CPU per pair (glide's own threads included) and pairs per second,
medians of interleaved rounds, as a markdown table.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from bench.micro import run_async
from starlette_idempotency.testing.redis_server import RedisServer

ROUNDS = 5
CONCURRENCY = 32
PAIRS_PER_CALLER = 300
_LOCK = b"x" * 200  # about a pending record
_RECORD = b"y" * 600  # about a completed record with a 300-byte response

Command = Callable[[str], Awaitable[Any]]


async def _pairs(acquire: Command, complete: Command) -> tuple[float, float]:
    """CPU µs per pair and pairs per second, ``CONCURRENCY`` callers on fresh keys."""
    run = uuid.uuid4().hex

    async def caller(number: int) -> None:
        for i in range(PAIRS_PER_CALLER):
            key = f"bench-clients:{run}:{number}:{i}"
            await acquire(key)
            await complete(key)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller(n) for n in range(CONCURRENCY)))
    pairs = CONCURRENCY * PAIRS_PER_CALLER
    return (time.process_time() - cpu) * 1e6 / pairs, pairs / (time.perf_counter() - wall)


async def _redis_py(port: int, parser: str) -> tuple[Command, Command, Callable[[], Any]]:
    import redis.asyncio as aioredis
    from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

    parser_class = _AsyncHiredisParser if parser == "hiredis" else _AsyncRESP3Parser
    pool = aioredis.ConnectionPool(port=port, max_connections=1000, parser_class=parser_class)
    client = aioredis.Redis.from_pool(pool)

    async def acquire(key: str) -> Any:
        return await client.set(key, _LOCK, nx=True, px=30_000, get=True)

    async def complete(key: str) -> Any:
        return await client.set(key, _RECORD, px=60_000)

    return acquire, complete, client.aclose


async def _glide(port: int) -> tuple[Command, Command, Callable[[], Any]]:
    from glide import (
        ConditionalChange,
        ExpirySet,
        ExpiryType,
        GlideClient,
        GlideClientConfiguration,
        NodeAddress,
    )

    client = await GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))
    lock_ttl, retention = (
        ExpirySet(ExpiryType.MILLSEC, 30_000),
        ExpirySet(ExpiryType.MILLSEC, 60_000),
    )

    async def acquire(key: str) -> Any:
        return await client.set(
            key,
            _LOCK,
            conditional_set=ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
            expiry=lock_ttl,
            return_old_value=True,
        )

    async def complete(key: str) -> Any:
        return await client.set(key, _RECORD, expiry=retention)

    return acquire, complete, client.close


def _available() -> list[str]:
    clients = ["redis-py"]
    try:
        import hiredis  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        pass
    else:
        clients.append("redis-py + hiredis")
    return [*clients, "valkey-glide"]


async def measure(port: int) -> dict[str, list[tuple[float, float]]]:
    """Per client, one (CPU µs per pair, pairs/s) sample per round, rounds interleaved."""
    commands = {}
    for name in _available():
        if name == "valkey-glide":
            commands[name] = await _glide(port)
        else:
            commands[name] = await _redis_py(port, "hiredis" if "hiredis" in name else "python")
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    try:
        for acquire, complete, _ in commands.values():
            await _pairs(acquire, complete)  # warm-up: connections, code paths
        for _ in range(ROUNDS):
            for name, (acquire, complete, _) in commands.items():
                samples[name].append(await _pairs(acquire, complete))
    finally:
        for _, _, close in commands.values():
            await close()
    return samples


def report(samples: dict[str, list[tuple[float, float]]]) -> str:
    base_cpu = statistics.median(cpu for cpu, _ in samples["redis-py"])
    base_rate = statistics.median(rate for _, rate in samples["redis-py"])
    lines = [
        f"{CONCURRENCY} concurrent callers, SET NX PX GET + SET PX per pair, medians of "
        f"{ROUNDS} rounds.",
        "",
        "| client | CPU µs per pair | × redis-py | pairs/s | × redis-py |",
        "|---|---|---|---|---|",
    ]
    for name, values in samples.items():
        cpu = statistics.median(value for value, _ in values)
        rate = statistics.median(value for _, value in values)
        lines.append(
            f"| {name} | {cpu:.1f} | {cpu / base_cpu:.2f}x | {rate:,.0f} | "
            f"{rate / base_rate:.2f}x |"
        )
    if "redis-py + hiredis" not in samples:
        lines += ["", "Not installed: hiredis (`--group clients`)."]
    return "\n".join(lines)


def main() -> None:
    with RedisServer() as server:
        samples = run_async(lambda: measure(server.port))
    print(report(samples))


if __name__ == "__main__":
    main()
