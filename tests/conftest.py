from __future__ import annotations

pytest_plugins = ["tests.plugins.redis_servers", "tests.plugins.postgres_servers"]
