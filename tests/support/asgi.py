"""Raw ASGI scopes, for tests that call an app without an HTTP client in between."""

from __future__ import annotations

import asyncio

import httpx

from starlette_idempotency._types import ASGIApp, Scope


def post_scope(path: str, headers: list[tuple[bytes, bytes]]) -> Scope:
    """A POST to ``path`` as a server hands it to the app, with ``headers`` after its Host."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"t"), *headers],
        "server": ("t", 80),
        "client": ("c", 1),
    }


def payments_scope(*headers: tuple[bytes, bytes]) -> Scope:
    """A JSON POST to /payments, with ``headers`` added."""
    return post_scope("/payments", [(b"content-type", b"application/json"), *headers])


async def post_json(
    app: ASGIApp, path: str, body: bytes, key: str = "k1", *, raise_app_exceptions: bool = True
) -> httpx.Response:
    """A JSON POST of ``body`` with Idempotency-Key ``key``, through httpx, within 5 s."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        request = client.post(
            path, content=body, headers={"idempotency-key": key, "content-type": "application/json"}
        )
        return await asyncio.wait_for(request, 5)
