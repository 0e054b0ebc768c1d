from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg  # type: ignore[import-untyped]
import pytest

from tests.stores_pg.proxy import CuttingProxy


@pytest.fixture
async def sql(postgres_dsn: str) -> AsyncIterator[Any]:
    """A plain asyncpg connection for arranging and inspecting rows."""
    connection = await asyncpg.connect(postgres_dsn)
    yield connection
    await connection.close()


@pytest.fixture
async def proxy(postgres_dsn: str) -> AsyncIterator[CuttingProxy]:
    """A proxy in front of the test database, to lose an exchange (see ``proxy.py``)."""
    parts = urlsplit(postgres_dsn)
    if "://" not in postgres_dsn or parts.hostname is None or parts.hostname.startswith("/"):
        pytest.skip("the proxy needs a postgresql:// DSN with a TCP host")
    async with CuttingProxy(parts.hostname, parts.port or 5432) as running:
        yield running
