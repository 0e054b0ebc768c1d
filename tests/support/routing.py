"""Endpoints that say whether they ran, and the check that a URL reaches a guarded or an open
one: shared by the ``test_routing_*`` modules."""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from starlette.endpoints import HTTPEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from starlette_idempotency import idempotent

Endpoint = Callable[[Request], Awaitable[Response]]
#: How a route holds its endpoint: a function, a ``functools.partial`` of one, or an
#: ``HTTPEndpoint`` class (whose POST handler is the one decorated).
EndpointKind = Literal["function", "partial", "class"]


@dataclass
class Endpoints:
    """Endpoints that count their runs by name and answer ``{"ran": name}``."""

    runs: Counter[str] = field(default_factory=Counter)

    def make(self, name: str, *, guarded: bool) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            self.runs[name] += 1
            return JSONResponse({"ran": name})

        return idempotent()(endpoint) if guarded else endpoint

    def of_kind(self, name: str, *, guarded: bool, kind: EndpointKind) -> Any:
        """What a route is given for ``name``, held as ``kind`` says."""
        if kind == "function":
            return self.make(name, guarded=guarded)
        if kind == "partial":

            async def endpoint(request: Request, *, ran: str) -> Response:
                self.runs[ran] += 1
                return JSONResponse({"ran": ran})

            return functools.partial(idempotent()(endpoint) if guarded else endpoint, ran=name)
        handler = self.make(name, guarded=False)

        async def post(self: HTTPEndpoint, request: Request) -> Response:
            return await handler(request)

        async def get(self: HTTPEndpoint, request: Request) -> Response:
            return await handler(request)

        decorated = idempotent()(post) if guarded else post
        return type(f"Endpoint_{name}", (HTTPEndpoint,), {"post": decorated, "get": get})

    def guarded(self, name: str) -> Endpoint:
        return self.make(name, guarded=True)

    def open(self, name: str) -> Endpoint:
        return self.make(name, guarded=False)


async def assert_behaviour(
    client: httpx.AsyncClient, url: str, endpoints: Endpoints, name: str, *, guarded: bool
) -> None:
    """POST ``url`` twice with one fresh key, then once without a key. A guarded endpoint runs
    once, is replayed, and demands a key (400); an open one runs every time."""
    key = {"Idempotency-Key": uuid.uuid4().hex}
    before = endpoints.runs[name]
    first = await client.post(url, headers=key)
    retry = await client.post(url, headers=key)
    keyless = await client.post(url)
    assert first.status_code == 200, first.text
    assert first.json() == {"ran": name}
    if guarded:
        assert retry.headers.get("x-idempotent-replay") == "true"
        assert keyless.status_code == 400, keyless.text
        assert endpoints.runs[name] == before + 1
    else:
        assert "x-idempotent-replay" not in retry.headers
        assert keyless.json() == {"ran": name}
        assert endpoints.runs[name] == before + 3


class Rewriting:
    """A middleware that serves ``/v1/...`` from the routes at ``/...``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scope = {**scope, "path": scope["path"].removeprefix("/v1")}
        await self.app(scope, receive, send)
