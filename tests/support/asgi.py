"""Raw ASGI scopes, for tests that call an app without an HTTP client in between."""

from __future__ import annotations

from starlette_idempotency._types import Scope


def payments_scope(*headers: tuple[bytes, bytes]) -> Scope:
    """A JSON POST to /payments as a server hands it to the app, with ``headers`` added."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"t"), (b"content-type", b"application/json"), *headers],
        "server": ("t", 80),
        "client": ("c", 1),
    }
