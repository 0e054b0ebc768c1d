"""Deprecated alias of the project's own throwaway PostgreSQL launcher (private since 0.2.0).

An app's tests get a PostgreSQL from the pytest plugin's ``postgres_dsn`` fixture instead
(:mod:`starlette_idempotency.testing.pytest_plugin`). Removed in 0.3.0.
"""

from __future__ import annotations

from starlette_idempotency._deprecation import deprecated
from starlette_idempotency.testing._postgres_server import PostgresServer, postgres_bin_dirs

deprecated(
    "starlette_idempotency.testing.postgres_server is private since 0.2.0: an app's tests get a "
    "server from the pytest plugin's postgres_dsn fixture",
    stacklevel=2,
)

__all__ = ["PostgresServer", "postgres_bin_dirs"]
