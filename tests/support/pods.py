"""Two app processes ("pods") on one store, as the ``pods`` fixture of the store tests hands
them to a test."""

from __future__ import annotations

from dataclasses import dataclass

import httpx


@dataclass
class Pods:
    """Clients of the two pods of :func:`pod_urls`: the one that runs a handler first, and
    the one a retry goes to."""

    holder: httpx.AsyncClient
    retrier: httpx.AsyncClient
