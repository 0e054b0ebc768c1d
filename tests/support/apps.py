"""Tiny FastAPI and Starlette apps with the same guarded endpoints, for the contract tests."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import idempotent, mark_retryable


@dataclass
class Ledger:
    """What the endpoints did: executions per path, and gates that hold handlers."""

    executions: Counter[str] = field(default_factory=Counter)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    entered: dict[str, asyncio.Event] = field(default_factory=dict)

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def entered_event(self, name: str) -> asyncio.Event:
        return self.entered.setdefault(name, asyncio.Event())

    async def hold(self, request_gate: str | None) -> None:
        if request_gate:
            self.entered_event(request_gate).set()
            await self.gate(request_gate).wait()


def _boom() -> None:
    raise RuntimeError("background task failed after the response")


async def _payment_response(ledger: Ledger, data: dict[str, Any], gate: str | None) -> Response:
    ledger.executions["payments"] += 1
    await ledger.hold(gate)
    number = ledger.executions["payments"]
    response = JSONResponse(
        {"paymentId": f"p_{number}", "amount": data.get("amount")},
        status_code=201,
        headers={"Location": f"/payments/p_{number}"},
    )
    response.set_cookie("session", "secret")
    return response


def _status_response(ledger: Ledger, code: int) -> Response:
    ledger.executions[f"status-{code}"] += 1
    return JSONResponse({"status": code}, status_code=code)


def _binary_response(ledger: Ledger) -> Response:
    ledger.executions["binary"] += 1
    return Response(bytes(range(256)) * 4, media_type="application/octet-stream")


def _stream_response(ledger: Ledger) -> Response:
    ledger.executions["stream"] += 1

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"one,", b"two,", b"three"):
            yield part

    return StreamingResponse(chunks(), media_type="text/plain")


def _after_response_failure(ledger: Ledger) -> Response:
    ledger.executions["background"] += 1
    return JSONResponse({"ok": True}, background=BackgroundTask(_boom))


def build_starlette_app(ledger: Ledger) -> Starlette:
    @idempotent()
    async def payments(request: Request) -> Response:
        data = await request.json()
        return await _payment_response(ledger, data, request.headers.get("x-gate"))

    async def put_payments(request: Request) -> Response:  # PUT is not guarded: its own route
        ledger.executions["put"] += 1
        return JSONResponse({"n": ledger.executions["put"]})

    @idempotent()
    async def status(request: Request) -> Response:
        return _status_response(ledger, int(request.path_params["code"]))

    @idempotent()
    async def crash(request: Request) -> Response:
        ledger.executions["crash"] += 1
        raise RuntimeError("handler crashed")

    @idempotent()
    async def retryable(request: Request) -> Response:
        ledger.executions["retryable"] += 1
        mark_retryable(request)
        return JSONResponse({"error": "duplicate e-mail"}, status_code=400)

    @idempotent(required=False)
    async def optional(request: Request) -> Response:
        ledger.executions["optional"] += 1
        return JSONResponse({"n": ledger.executions["optional"]})

    @idempotent()
    async def echo(request: Request) -> Response:
        ledger.executions["echo"] += 1
        body = await request.body()
        return Response(body, media_type=request.headers.get("content-type", "text/plain"))

    @idempotent()
    async def binary(request: Request) -> Response:
        return _binary_response(ledger)

    @idempotent()
    async def stream(request: Request) -> Response:
        return _stream_response(ledger)

    @idempotent()
    async def background(request: Request) -> Response:
        return _after_response_failure(ledger)

    @idempotent(renew_lock=False, lock_ttl_seconds=5)
    async def short_lock(request: Request) -> Response:
        ledger.executions["short-lock"] += 1
        number = ledger.executions["short-lock"]
        await ledger.hold(request.headers.get("x-gate"))
        return JSONResponse({"n": number})

    async def unguarded(request: Request) -> Response:
        ledger.executions["unguarded"] += 1
        return JSONResponse({"n": ledger.executions["unguarded"]})

    return Starlette(
        routes=[
            Route("/payments", payments, methods=["POST"]),
            Route("/payments", put_payments, methods=["PUT"]),
            Route("/refunds", payments, methods=["POST"]),
            Route("/status/{code:int}", status, methods=["POST"]),
            Route("/crash", crash, methods=["POST"]),
            Route("/retryable", retryable, methods=["POST"]),
            Route("/optional", optional, methods=["PATCH"]),
            Route("/echo", echo, methods=["POST"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/background", background, methods=["POST"]),
            Route("/short-lock", short_lock, methods=["POST"]),
            Route("/unguarded", unguarded, methods=["POST"]),
        ]
    )


class Payment(BaseModel):
    amount: str
    currency: str = "EUR"


def require_token(request: Request) -> None:
    if request.headers.get("authorization") != "Bearer ok":
        raise HTTPException(status_code=401, detail="not authenticated")


def build_fastapi_app(ledger: Ledger) -> FastAPI:
    app = FastAPI()

    @app.post("/payments", status_code=201)
    @idempotent()
    async def payments(body: Payment, request: Request) -> Response:
        return await _payment_response(ledger, body.model_dump(), request.headers.get("x-gate"))

    @app.put("/payments")  # not decorated: the middleware guards POST and PATCH only
    async def put_payments(body: Payment) -> dict[str, int]:
        ledger.executions["put"] += 1
        return {"n": ledger.executions["put"]}

    @app.post("/refunds")
    @idempotent()
    async def refunds(body: Payment, request: Request) -> Response:
        return await _payment_response(ledger, body.model_dump(), request.headers.get("x-gate"))

    @app.post("/status/{code}")
    @idempotent()
    async def status(code: int) -> Response:
        return _status_response(ledger, code)

    @app.post("/crash")
    @idempotent()
    async def crash() -> None:
        ledger.executions["crash"] += 1
        raise RuntimeError("handler crashed")

    @app.post("/retryable")
    @idempotent()
    async def retryable(request: Request) -> Response:
        ledger.executions["retryable"] += 1
        mark_retryable(request)
        return JSONResponse({"error": "duplicate e-mail"}, status_code=400)

    @app.patch("/optional")
    @idempotent(required=False)
    def optional() -> dict[str, int]:  # sync on purpose: runs in a worker thread
        ledger.executions["optional"] += 1
        return {"n": ledger.executions["optional"]}

    @app.post("/echo")
    @idempotent()
    async def echo(request: Request) -> Response:
        ledger.executions["echo"] += 1
        body = await request.body()
        return Response(body, media_type=request.headers.get("content-type", "text/plain"))

    @app.post("/binary")
    @idempotent()
    async def binary() -> Response:
        return _binary_response(ledger)

    @app.post("/stream")
    @idempotent()
    async def stream() -> Response:
        return _stream_response(ledger)

    @app.post("/background")
    @idempotent()
    async def background() -> Response:
        return _after_response_failure(ledger)

    @app.post("/short-lock")
    @idempotent(renew_lock=False, lock_ttl_seconds=5)
    async def short_lock(request: Request) -> dict[str, int]:
        ledger.executions["short-lock"] += 1
        number = ledger.executions["short-lock"]
        await ledger.hold(request.headers.get("x-gate"))
        return {"n": number}

    @app.post("/unguarded")
    async def unguarded() -> dict[str, int]:
        ledger.executions["unguarded"] += 1
        return {"n": ledger.executions["unguarded"]}

    @app.post("/secured", dependencies=[Depends(require_token)])
    @idempotent()
    async def secured(body: Payment) -> dict[str, str]:
        ledger.executions["secured"] += 1
        return {"amount": body.amount}

    @app.post("/handler-422")
    @idempotent()
    async def handler_422() -> Response:
        ledger.executions["handler-422"] += 1
        return JSONResponse({"error": "amount too high"}, status_code=422)

    return app
