"""A short run of the stress test (``examples/payments/stress.py``) in the default suite.

``task test:stress:all`` runs the long one (30 s at 50 requests/s).
"""

from __future__ import annotations

import pytest
from examples.payments.cluster import Cluster
from examples.payments.stress import run_stress

pytestmark = pytest.mark.e2e


async def test_short_stress_run_never_executes_twice(redis_cluster: Cluster) -> None:
    report = await run_stress(redis_cluster.url, rps=50, duration=5, seed=7)
    print(report.format())
    assert report.ok, report.format()
    assert report.duplicates == 0
    assert report.misuse_sent > 0
    assert report.misuse_422 == report.misuse_sent
    assert report.keys["order"] > 0
    assert set(report.pods_seen) == set(redis_cluster.pods)
    assert not any(status >= 500 for status in report.statuses)
