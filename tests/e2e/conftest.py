"""End-to-end fixtures: whole demo clusters (nginx, two uvicorn pods, Redis, PostgreSQL).

Each cluster is started once per run, on free ports, with servers of its own (never the shared
Redis or PostgreSQL), and stopped at the end of the run whatever happened. ``cluster`` is
parametrised over the two idempotency stores; ``redis_cluster`` is the Redis one alone. Before
each test, anything an earlier test stopped (a pod, Redis) is started again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from examples.payments.cluster import Cluster, StoreKind

# Short, so the crash scenario waits 2 s for the lock to lapse instead of 60 s.
LOCK_TTL_SECONDS = 2.0


class Clusters:
    """Starts one cluster per store on first use and stops them all at the end."""

    def __init__(self) -> None:
        self._running: dict[StoreKind, Cluster] = {}

    def get(self, store: StoreKind) -> Cluster:
        if store not in self._running:
            cluster = Cluster(store=store, payments_lock_ttl_seconds=LOCK_TTL_SECONDS)
            cluster.start()  # stops what it started if it fails half-way
            self._running[store] = cluster
        cluster = self._running[store]
        cluster.heal()
        return cluster

    def close(self) -> None:
        errors = []
        for cluster in self._running.values():
            try:
                cluster.close()
            except Exception as exc:
                errors.append(exc)
        self._running.clear()
        if errors:
            raise errors[0]


@pytest.fixture(scope="session")
def clusters() -> Iterator[Clusters]:
    running = Clusters()
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(params=["redis", "postgres"])
def cluster(request: pytest.FixtureRequest, clusters: Clusters) -> Cluster:
    """The demo on each idempotency store in turn."""
    store: StoreKind = request.param
    return clusters.get(store)


@pytest.fixture
def redis_cluster(clusters: Clusters) -> Cluster:
    """The demo on RedisStore (its own Redis server, free to stop)."""
    return clusters.get("redis")


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client through nginx."""
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as http:
        yield http
