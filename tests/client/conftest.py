"""The client tests' server: see :mod:`tests.support.live_server`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.live_server import LiveServer, serve


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    """The test app behind a real uvicorn, with the default error format."""
    yield from serve()
