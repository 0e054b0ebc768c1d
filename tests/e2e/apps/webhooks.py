"""Webhook receivers on RedisStore (``$IDEM_TEST_REDIS_URL``, keys under ``$IDEM_TEST_PREFIX``),
each taking its key from another source (``key_from``), and two routes with a key policy.

Every handler counts its runs by route and key (``GET /state``) and, with ``X-Hold: NAME`` (a
header, which the fingerprint leaves out), waits until ``POST /release?name=NAME``. A JSON body
with ``"fail": true`` answers 500; with ``"raise": true`` the handler raises.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections import Counter, defaultdict

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    IdempotencyMiddleware,
    KeySource,
    RedisStore,
    idempotency_context,
    idempotent,
)

GITHUB_SECRET = b"it's a secret to everybody"


def github_signature(body: bytes) -> str:
    """``X-Hub-Signature-256`` as GitHub signs a delivery."""
    return "sha256=" + hmac.new(GITHUB_SECRET, body, hashlib.sha256).hexdigest()


async def github_delivery(request: HTTPConnection, body: bytes) -> str | None:
    """The delivery's id, once its signature is verified: the raw body is at hand here."""
    # The header's bytes: compare_digest raises a TypeError (a 500) for a non-ASCII str.
    signature = request.headers.get("x-hub-signature-256", "").encode("latin-1")
    if not hmac.compare_digest(signature, github_signature(body).encode()):
        raise HTTPException(401, "bad signature")
    return request.headers.get("x-github-delivery")


def create_app() -> Starlette:
    runs: Counter[str] = Counter()
    released: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def handle(request: Request) -> Response:
        runs[f"{request.url.path} {idempotency_context(request).key}"] += 1
        hold = request.headers.get("x-hold")
        if hold:
            await asyncio.wait_for(released[hold].wait(), 10)
        body = await request.json()
        if body.get("raise"):
            raise RuntimeError("the handler failed")
        if body.get("fail"):
            return JSONResponse({"error": "downstream failed"}, status_code=500)
        return JSONResponse({"received": True, "runs": sum(runs.values())})

    standard = idempotent(key_from=KeySource.header("webhook-id"), on_in_progress="wait")(handle)
    nested = idempotent(key_from=KeySource.json_field("event.data.id"))(handle)
    github = idempotent(key_from=github_delivery)(handle)
    stripe = idempotent(
        key_from=KeySource.json_field("id"),
        release_statuses=(),
        exclude_fields=["pending_webhooks"],
    )(handle)
    uuid_only = idempotent(key_format="uuid")(handle)

    @idempotent()
    async def payments(request: Request) -> Response:
        runs[f"/payments {idempotency_context(request).key}"] += 1
        number = sum(runs.values())
        return JSONResponse(
            {"paymentId": number}, status_code=201, headers={"Location": f"/payments/{number}"}
        )

    async def release(request: Request) -> Response:
        released[request.query_params["name"]].set()
        return JSONResponse({})

    async def state(request: Request) -> Response:
        return JSONResponse(dict(runs))

    store = RedisStore.from_url(
        os.environ["IDEM_TEST_REDIS_URL"], key_prefix=os.environ["IDEM_TEST_PREFIX"]
    )
    middleware = Middleware(
        IdempotencyMiddleware,
        store=store,
        key_scope=lambda request: "webhooks",
        max_body_bytes=1024,
        wait_timeout_seconds=10,
    )
    routes = [
        Route("/standard", standard, methods=["POST"]),
        Route("/nested", nested, methods=["POST"]),
        Route("/github", github, methods=["POST"]),
        Route("/stripe", stripe, methods=["POST"]),
        Route("/uuid", uuid_only, methods=["POST"]),
        Route("/payments", payments, methods=["POST"]),
        Route("/release", release, methods=["POST"]),
        Route("/state", state),
    ]
    return Starlette(routes=routes, middleware=[middleware])
