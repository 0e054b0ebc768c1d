"""The apps under test: one Starlette and one FastAPI app, each built bare or guarded.

Every endpoint writes an :class:`Execution` to the app's :class:`AppLog` when it starts (a
serial number, the key field lines and the body it received) and puts that serial in an
``x-serial`` header, so the checks can tell which execution a response, or a replay, came from.
Each endpoint also reports its *view*: the request as it understands it (``oracle.canonical``),
which is what "the same request" means for invariant 4.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._options import InProgressPolicy
from starlette_idempotency.testing import FakeClock
from tests.support.property.oracle import canonical, raw_meaning

KEY_HEADER = "idempotency-key"
EXCLUDED = ("clientTimestamp", "nonce")
VALIDATED_EXCLUDED = ("note", "clientTimestamp")
MAX_BODY_BYTES = 16 * 1024


@dataclass(slots=True)
class Execution:
    """One run of an endpoint: what it received, what it made of it, what it answered."""

    serial: int
    template: str
    method: str
    key_values: tuple[bytes, ...]
    body: bytes
    view: str = ""
    status: int | None = None


@dataclass(slots=True)
class AppLog:
    executions: list[Execution] = field(default_factory=list)

    def start(self, request: Request, template: str, body: bytes) -> Execution:
        execution = Execution(
            serial=len(self.executions) + 1,
            template=template,
            method=request.method,
            key_values=tuple(
                value.encode("latin-1") for value in request.headers.getlist(KEY_HEADER)
            ),
            body=body,
        )
        self.executions.append(execution)
        return execution


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """A route of an app under test: its template, the paths to call and the methods it
    accepts (the middleware guards POST and PATCH only)."""

    name: str
    template: str
    paths: tuple[str, ...]
    methods: tuple[str, ...]
    streams: bool = False
    model: bool = False


async def _yield_to_others(request: Request) -> None:
    raw = request.headers.get("x-yields", "0")
    for _ in range(int(raw) if raw.isdigit() else 0):
        await asyncio.sleep(0)


def _answer(execution: Execution, status: int, *, stream: bool = False) -> Response:
    execution.status = status
    digest = hashlib.sha256(execution.view.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    payload = {"serial": execution.serial, "route": execution.template, "view": digest}
    headers = {"x-serial": str(execution.serial), "location": f"/things/{execution.serial}"}
    if stream:
        text = bytes(JSONResponse(payload).body)

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(text), 7):
                await asyncio.sleep(0)
                yield text[start : start + 7]

        return StreamingResponse(
            chunks(), status_code=status, headers=headers, media_type="application/json"
        )
    response = JSONResponse(payload, status_code=status, headers=headers)
    response.set_cookie("session", f"s{execution.serial}")
    return response


def _json_status(value: Any) -> int:
    if isinstance(value, dict):
        return 201
    return 200 if isinstance(value, list) else 202


async def _json_endpoint(
    log: AppLog, request: Request, template: str, excluded: frozenset[str]
) -> Response:
    """Reads the body with ``Request.json()``; a body it cannot read is a stored 400."""
    execution = log.start(request, template, await request.body())
    await _yield_to_others(request)
    try:
        value = await request.json()
    except (ValueError, RecursionError):
        # Every body it cannot read gets the same answer: to this endpoint they are one.
        execution.view = f"{request.url.path}|not JSON"
        return _answer(execution, 400)
    execution.view = f"{request.url.path}|json:{canonical(value, excluded)}"
    return _answer(execution, _json_status(value))


async def _raw_endpoint(log: AppLog, request: Request, template: str, stream: bool) -> Response:
    execution = log.start(request, template, await request.body())
    await _yield_to_others(request)
    execution.view = f"{request.url.path}|{raw_meaning(execution.body)}"
    return _answer(execution, 200, stream=stream)


def _lower(names: tuple[str, ...]) -> frozenset[str]:
    return frozenset(name.lower() for name in names)


STARLETTE_ROUTES = (
    RouteInfo("json", "/json", ("/json",), ("POST", "PATCH", "PUT")),
    RouteInfo("raw", "/raw", ("/raw",), ("POST",)),
    RouteInfo("exclude", "/exclude", ("/exclude",), ("POST",)),
    RouteInfo("stream", "/stream", ("/stream",), ("POST",), streams=True),
    RouteInfo("param", "/param/{tenant}", ("/param/a", "/param/b"), ("POST",)),
)


def build_starlette(log: AppLog) -> Starlette:
    @idempotent()
    async def json_route(request: Request) -> Response:
        return await _json_endpoint(log, request, "/json", frozenset())

    async def json_put(request: Request) -> Response:  # PUT is not guarded: a route of its own
        return await _json_endpoint(log, request, "/json", frozenset())

    @idempotent()
    async def raw_route(request: Request) -> Response:
        return await _raw_endpoint(log, request, "/raw", stream=False)

    @idempotent(exclude_fields=EXCLUDED)
    async def exclude_route(request: Request) -> Response:
        return await _json_endpoint(log, request, "/exclude", _lower(EXCLUDED))

    @idempotent()
    async def stream_route(request: Request) -> Response:
        return await _raw_endpoint(log, request, "/stream", stream=True)

    @idempotent()
    async def param_route(request: Request) -> Response:
        return await _json_endpoint(log, request, "/param/{tenant}", frozenset())

    return Starlette(
        routes=[
            Route("/json", json_route, methods=["POST", "PATCH"]),
            Route("/json", json_put, methods=["PUT"]),
            Route("/raw", raw_route, methods=["POST"]),
            Route("/exclude", exclude_route, methods=["POST"]),
            Route("/stream", stream_route, methods=["POST"]),
            Route("/param/{tenant}", param_route, methods=["POST"]),
        ]
    )


class Payment(BaseModel):
    amount: float
    currency: str = "EUR"
    quantity: int = 1
    fee: float | None = None
    tags: tuple[str, ...] = ()
    note: str | None = None
    meta: dict[str, Any] | None = None


def _model_view(body: Payment, excluded: frozenset[str]) -> str:
    try:
        return "model:" + canonical(body.model_dump(), excluded)
    except Exception as exc:  # a view that cannot be computed must not turn into a 500
        return f"model-unviewable:{type(exc).__name__}"


async def _model_endpoint(
    log: AppLog, body: Payment, request: Request, template: str, excluded: frozenset[str]
) -> Response:
    execution = log.start(request, template, await request.body())
    await _yield_to_others(request)
    execution.view = f"{request.url.path}|{_model_view(body, excluded)}"
    return _answer(execution, 201)


FASTAPI_ROUTES = (
    RouteInfo("model", "/model", ("/model",), ("POST", "PATCH"), model=True),
    RouteInfo("raw", "/raw", ("/raw",), ("POST",)),
    RouteInfo("exclude", "/exclude", ("/exclude",), ("POST",)),
    RouteInfo("validated", "/validated", ("/validated",), ("POST",), model=True),
    RouteInfo(
        "validated-exclude", "/validated-exclude", ("/validated-exclude",), ("POST",), model=True
    ),
)


def build_fastapi(log: AppLog) -> FastAPI:
    app = FastAPI()

    @app.post("/model")
    @app.patch("/model")
    @idempotent()
    async def model_route(body: Payment, request: Request) -> Response:
        return await _model_endpoint(log, body, request, "/model", frozenset())

    @app.post("/raw")
    @idempotent()
    async def raw_route(request: Request) -> Response:
        return await _raw_endpoint(log, request, "/raw", stream=False)

    @app.post("/exclude")
    @idempotent(exclude_fields=EXCLUDED)
    async def exclude_route(request: Request) -> Response:
        return await _json_endpoint(log, request, "/exclude", _lower(EXCLUDED))

    @app.post("/validated")
    @idempotent(fingerprint="validated")
    async def validated_route(body: Payment, request: Request) -> Response:
        return await _model_endpoint(log, body, request, "/validated", frozenset())

    @app.post("/validated-exclude")
    @idempotent(fingerprint="validated", exclude_fields=VALIDATED_EXCLUDED)
    async def validated_exclude_route(body: Payment, request: Request) -> Response:
        return await _model_endpoint(
            log, body, request, "/validated-exclude", _lower(VALIDATED_EXCLUDED)
        )

    return app


BUILDERS: dict[str, Callable[[AppLog], Starlette]] = {
    "starlette": build_starlette,
    "fastapi": build_fastapi,
}
ROUTES: dict[str, tuple[RouteInfo, ...]] = {
    "starlette": STARLETTE_ROUTES,
    "fastapi": FASTAPI_ROUTES,
}


@dataclass(frozen=True, slots=True)
class MiddlewareOptions:
    on_in_progress: InProgressPolicy = "conflict"


def build_app(kind: str, log: AppLog, options: MiddlewareOptions | None) -> Starlette:
    """The app of ``kind``; guarded by the middleware over a fresh MemoryStore unless
    ``options`` is ``None`` (the bare app)."""
    app = BUILDERS[kind](log)
    if options is not None:
        clock = FakeClock()
        app.add_middleware(
            IdempotencyMiddleware,
            store=MemoryStore(clock=clock),
            clock=clock,
            max_body_bytes=MAX_BODY_BYTES,
            on_in_progress=options.on_in_progress,
            wait_timeout_seconds=5.0,
        )
    return app
