"""What ``RedisStore(wait_replicas=1)`` costs: acquires against a primary with one replica.

``python -m bench.replicas`` starts a private primary and a replica of it, then times
sequential and concurrent acquires of fresh keys with ``wait_replicas=0`` and ``1``,
interleaved over rounds, and prints a markdown table (medians).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

from starlette_idempotency import RedisStore
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from starlette_idempotency.testing._processes import wait_until
from starlette_idempotency.testing._redis_server import RedisServer

ROUNDS = 5
ACQUIRES = 2000
CONCURRENCY = 32


def _pending(key: str) -> IdempotencyRecord:
    now = time.time()
    return IdempotencyRecord(key, RecordStatus.IN_PROGRESS, "sha256:x", "owner", now, now + 30)


async def _acquires_per_second(url: str, wait_replicas: int, concurrency: int) -> float:
    store = RedisStore.from_url(
        url, key_prefix=f"bench-{uuid.uuid4().hex}", wait_replicas=wait_replicas
    )
    try:
        keys = [uuid.uuid4().hex for _ in range(ACQUIRES)]
        queue = iter(keys)

        async def worker() -> None:
            for key in queue:
                assert (await store.try_acquire(key, _pending(key), 30)).acquired

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ACQUIRES / (time.perf_counter() - started)
    finally:
        await store.aclose()


def main() -> None:
    with (
        RedisServer() as primary,
        RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)]) as replica,
    ):
        wait_until(
            lambda: b"master_link_status:up" in replica.command("INFO", "replication"),
            timeout=30,
            what="the replica to sync",
        )
        rows = []
        for concurrency in (1, CONCURRENCY):
            rates: dict[int, list[float]] = {0: [], 1: []}
            for _ in range(ROUNDS):
                for wait_replicas in (0, 1):
                    rates[wait_replicas].append(
                        asyncio.run(_acquires_per_second(primary.url, wait_replicas, concurrency))
                    )
            plain, waited = statistics.median(rates[0]), statistics.median(rates[1])
            rows.append(f"| {concurrency} | {plain:,.0f} | {waited:,.0f} | {waited / plain:.2f}x |")
    print("| concurrent callers | acquires/s, wait_replicas=0 | wait_replicas=1 | ratio |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
