"""An app for ``uvicorn --workers N`` with ``PROMETHEUS_MULTIPROC_DIR`` set: ``POST /pay``
(guarded, on the Redis ``$IDEM_TEST_REDIS_URL`` under ``$IDEM_TEST_PREFIX``) and ``/metrics``
(:func:`metrics_app`, the sum over every worker); every response names the worker that sent it
in ``X-Worker-Pid``."""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, PrometheusMetrics, RedisStore, idempotent
from starlette_idempotency.prometheus import metrics_app


class WorkerPid:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_pid(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-worker-pid"] = str(os.getpid())
            await send(message)

        await self.app(scope, receive, send_with_pid)


@idempotent()
async def pay(request: Request) -> Response:
    return JSONResponse({"paid": True}, status_code=201)


app = Starlette(routes=[Route("/pay", pay, methods=["POST"]), Mount("/metrics", metrics_app())])
app.add_middleware(WorkerPid)
app.add_middleware(
    IdempotencyMiddleware,
    store=RedisStore.from_url(
        os.environ["IDEM_TEST_REDIS_URL"], key_prefix=os.environ["IDEM_TEST_PREFIX"]
    ),
    metrics=PrometheusMetrics(),
)
