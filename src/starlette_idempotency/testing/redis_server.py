"""Deprecated alias of the project's own throwaway Redis launcher (private since 0.2.0).

An app's tests get a Redis from the pytest plugin's ``redis_url`` fixture instead
(:mod:`starlette_idempotency.testing.pytest_plugin`). Removed in 0.3.0.
"""

from __future__ import annotations

from starlette_idempotency._deprecation import deprecated
from starlette_idempotency.testing._redis_server import (
    RedisClusterServers,
    RedisServer,
    encode_command,
    redis_command,
)

deprecated(
    "starlette_idempotency.testing.redis_server is private since 0.2.0: an app's tests get a "
    "server from the pytest plugin's redis_url fixture",
    stacklevel=2,
)

__all__ = ["RedisClusterServers", "RedisServer", "encode_command", "redis_command"]
