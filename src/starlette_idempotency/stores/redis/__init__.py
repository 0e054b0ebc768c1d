"""The Redis store, on redis-py or valkey-glide (:class:`RedisStore`).

The modules inside are private: ``_store`` holds the store and its Lua-fenced operations,
``_driver`` the small interface both client libraries are adapted to (``_redis_py`` and
``_glide``), ``_changes`` the pub/sub listener that wakes waiting duplicates.
"""

from __future__ import annotations

from starlette_idempotency.stores.redis._store import AcquireStrategy, DriverName, RedisStore

__all__ = ["AcquireStrategy", "DriverName", "RedisStore"]
