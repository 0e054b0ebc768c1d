"""The app ``test_postgres_uvicorn`` runs in a uvicorn process: one idempotent POST over
PostgresStore, configured by environment variables.

A request carrying ``X-Terminate-Connections`` first has the server end every connection of
the app's pool (``pg_terminate_backend``), blocking the process's event loop until the backends
have exited: so the pool has not seen it when the store's first statement goes out, as for a
request that arrives just as the database restarts or fails over. One carrying ``X-Wait-For:
PATH`` blocks the event loop the same way until the file ``PATH`` exists (it writes
``PATH.waiting`` first), while the test does to the server what it likes (a crash, an
immediate restart).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette_idempotency import IdempotencyMiddleware, PostgresStore, idempotent
from tests.support.postgres import terminate_backends

TERMINATE_HEADER = b"x-terminate-connections"
WAIT_HEADER = b"x-wait-for"


def block_until_exists(path: Path) -> None:
    """Block this thread (the event loop's) until ``path`` exists."""
    path.with_name(path.name + ".waiting").touch()
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class TerminateConnectionsFirst:
    """Ends the pool's connections (``TERMINATE_HEADER``), or waits for the test to do
    something of its own (``WAIT_HEADER``), before passing a marked request on, its body read
    first so that nothing waits in between."""

    def __init__(self, app: ASGIApp, *, dsn: str, application_name: str) -> None:
        self.app = app
        self.dsn = dsn
        self.application_name = application_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if TERMINATE_HEADER not in headers and WAIT_HEADER not in headers:
            await self.app(scope, receive, send)
            return
        body: list[Message] = [await receive()]
        while body[-1]["type"] == "http.request" and body[-1].get("more_body"):
            body.append(await receive())
        if WAIT_HEADER in headers:
            block_until_exists(Path(headers[WAIT_HEADER].decode()))
        else:
            terminated = terminate_backends(self.dsn, self.application_name)
            scope.setdefault("state", {})["terminated"] = terminated

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        await self.app(scope, replay, send)


def create_app() -> ASGIApp:
    """``uvicorn --factory tests.stores.postgres_uvicorn_app:create_app``."""
    dsn = os.environ["IDEM_TEST_DSN"]
    application_name = os.environ["IDEM_TEST_APPLICATION_NAME"]
    pool = asyncpg.create_pool(
        dsn, min_size=2, max_size=2, server_settings={"application_name": application_name}
    )
    store = PostgresStore(pool, table=os.environ["IDEM_TEST_TABLE"], operation_timeout=5.0)
    runs = 0

    @idempotent()
    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        terminated = getattr(request.state, "terminated", None)
        return JSONResponse({"run": runs, "terminated": terminated})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool  # opens its connections
        try:
            await store.create_schema()
            yield
        finally:
            await pool.close()

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"]), Route("/healthz", healthz)],
        lifespan=lifespan,
    )
    guarded = IdempotencyMiddleware(app, store=store, store_timeout_seconds=5.0)
    return TerminateConnectionsFirst(guarded, dsn=dsn, application_name=application_name)
