"""The suite gets its Redis and PostgreSQL from the public pytest plugin, as users do; the
project's own fixtures (private servers for outage tests, a Cluster) come on top of it."""

from __future__ import annotations

pytest_plugins = [
    "pytester",
    "starlette_idempotency.testing.pytest_plugin",
    "tests.plugins.redis_servers",
    "tests.plugins.postgres_servers",
]
