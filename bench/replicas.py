"""What ``RedisStore(wait_replicas=1)`` costs: acquires, and a request's two writes (the acquire
and the stored response, each ``WAIT``-ed for), against a primary with one replica.

``python -m bench.replicas`` starts a private primary and a replica of it, then times
sequential and concurrent acquires of fresh keys, and acquires each followed by its finish,
with ``wait_replicas=0`` and ``1``, interleaved over rounds, and prints a markdown table
(medians).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

from starlette_idempotency import RedisStore, StoredResponse
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from starlette_idempotency.testing._processes import wait_until
from starlette_idempotency.testing._redis_server import RedisServer

ROUNDS = 5
ACQUIRES = 2000
CONCURRENCY = 32


_RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"id":"p_1"}')


def _pending(key: str) -> IdempotencyRecord:
    now = time.time()
    return IdempotencyRecord(key, RecordStatus.IN_PROGRESS, "sha256:x", "owner", now, now + 30)


async def _per_second(url: str, wait_replicas: int, concurrency: int, finish: bool) -> float:
    """Acquires (each followed by its finish when ``finish``) per second."""
    store = RedisStore.from_url(
        url, key_prefix=f"bench-{uuid.uuid4().hex}", wait_replicas=wait_replicas
    )
    try:
        keys = [uuid.uuid4().hex for _ in range(ACQUIRES)]
        queue = iter(keys)

        async def worker() -> None:
            for key in queue:
                record = _pending(key)
                assert (await store.try_acquire(key, record, 30)).acquired
                if finish:
                    done = record.finished(RecordStatus.COMPLETED, _RESPONSE, record.expires_at)
                    assert await store.finish(key, done, 60)

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
        for finish in (False, True):
            for concurrency in (1, CONCURRENCY):
                rates: dict[int, list[float]] = {0: [], 1: []}
                for _ in range(ROUNDS):
                    for wait_replicas in (0, 1):
                        rate = _per_second(primary.url, wait_replicas, concurrency, finish)
                        rates[wait_replicas].append(asyncio.run(rate))
                plain, waited = statistics.median(rates[0]), statistics.median(rates[1])
                what = "acquire + finish" if finish else "acquire"
                rows.append(
                    f"| {what} | {concurrency} | {plain:,.0f} | {waited:,.0f} "
                    f"| {waited / plain:.2f}x |"
                )
    print("| writes | concurrent callers | per second, wait_replicas=0 | wait_replicas=1 | ratio |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
