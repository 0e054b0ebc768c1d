"""End-to-end fixtures: whole demo clusters (nginx, two uvicorn pods, Redis, PostgreSQL).

Each cluster is started once per run, on free ports, with servers of its own (never the shared
Redis or PostgreSQL), and stopped at the end of the run whatever happened. ``cluster`` is
parametrised over the two idempotency stores; ``redis_cluster`` and ``postgres_cluster`` are
one of them alone. Before
each test, anything an earlier test stopped (a pod, Redis) is started again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from examples.payments.cluster import Cluster, StoreKind

from tests.support.e2e import Clusters


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
def postgres_cluster(clusters: Clusters) -> Cluster:
    """The demo on PostgresStore (``POST /payments`` commits its record in its transaction)."""
    return clusters.get("postgres")


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client through nginx."""
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30.0) as http:
        yield http
