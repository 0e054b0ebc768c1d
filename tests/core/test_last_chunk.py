"""A response's last chunk goes out once its outcome is stored: after the app has returned
(its frames gone while the store answers), or, while the app runs on (background tasks),
apart from it, so that the client never waits for them."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency._types import ASGIApp, Receive, Scope, Send
from starlette_idempotency.stores.base import FencedWrite
from tests.support.conditions import eventually_sync
from tests.support.guarded import make_client
from tests.support.uvicorn import uvicorn_thread


class WatchedStore(MemoryStore):
    """Notes, when the outcome is stored, what the app had done by then."""

    def __init__(self, app_done: list[str]) -> None:
        super().__init__()
        self.app_done = app_done
        self.seen_at_finish: list[list[str]] = []

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        self.seen_at_finish.append(list(self.app_done))
        return await super().finish(key, record, ttl)


def paying_app(done: list[str], *, raise_after: bool = False) -> Starlette:
    """``POST /pay``, whose response notes in ``done`` that it has sent itself whole (and
    then raises, with ``raise_after``)."""

    class Paid(Response):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            await super().__call__(scope, receive, send)
            done.append("returned")
            if raise_after:
                raise RuntimeError("after the response")

    @idempotent()
    async def pay(request: Request) -> Response:
        return Paid(b'{"paid":1}', status_code=201)

    return Starlette(routes=[Route("/pay", pay, methods=["POST"])])


async def test_the_outcome_is_stored_once_the_app_has_returned() -> None:
    done: list[str] = []
    store = WatchedStore(done)
    client = make_client(
        IdempotencyMiddleware(paying_app(done), store=store, key_scope=lambda r: "t")
    )
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = await client.post("/pay", headers=headers)
    retry = await client.post("/pay", headers=headers)
    assert (first.status_code, first.content) == (201, b'{"paid":1}')
    assert store.seen_at_finish == [["returned"]]
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.content == first.content


async def test_an_app_raising_after_its_whole_response_still_sends_and_stores_it() -> None:
    done: list[str] = []
    store = WatchedStore(done)
    app = paying_app(done, raise_after=True)
    guarded = IdempotencyMiddleware(app, store=store, key_scope=lambda r: "t")
    client = make_client(guarded, raise_app_exceptions=False)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with pytest.raises(RuntimeError, match="after the response"):
        await make_client(guarded).post("/pay", headers=headers)
    retry = await client.post("/pay", headers=headers)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert (retry.status_code, retry.content) == (201, b'{"paid":1}')
    assert store.seen_at_finish == [["returned"]]


def with_background(task: Callable[[], Awaitable[None]], runs: list[str]) -> ASGIApp:
    """``POST /pay``, guarded, answering 201 with ``task`` as its background task; each run of
    the handler is noted in ``runs``."""

    @idempotent()
    async def pay(request: Request) -> Response:
        runs.append("handler")
        return JSONResponse({"paid": 1}, status_code=201, background=BackgroundTask(task))

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: "t")


def test_background_tasks_never_hold_back_the_response_and_its_retry_is_replayed() -> None:
    """Through uvicorn: the client has the whole response while the background task still
    waits, and a retry sent then is a replay."""
    release = threading.Event()
    ran: list[str] = []

    async def after_response() -> None:
        await asyncio.to_thread(release.wait)  # until the test lets it end
        ran.append("background")

    guarded = with_background(after_response, ran)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with uvicorn_thread(guarded) as url, httpx.Client(base_url=url, timeout=5) as client:
        try:
            first = client.post("/pay", headers=headers)
            retry = client.post("/pay", headers=headers)
            assert first.status_code == 201
            assert retry.headers["x-idempotent-replay"] == "true"
            assert ran == ["handler"]  # the background task still waits
        finally:
            release.set()
        eventually_sync(lambda: ran == ["handler", "background"], message="the background task")


@pytest.mark.parametrize("awaits_first", [False, True], ids=["at once", "after an await"])
async def test_a_background_task_raising_leaves_the_response_stored(awaits_first: bool) -> None:
    """Whether it raises before the app would return or once the outcome is on its way apart,
    the whole response goes out, is stored, and a retry is replayed, not run again."""
    runs: list[str] = []

    async def fails() -> None:
        if awaits_first:
            await asyncio.sleep(0)
        raise RuntimeError("the background task failed")

    guarded = with_background(fails, runs)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with pytest.raises(RuntimeError, match="the background task failed"):
        await make_client(guarded).post("/pay", headers=headers)
    retry = await make_client(guarded).post("/pay", headers=headers)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert (retry.status_code, retry.json()) == (201, {"paid": 1})
    assert runs == ["handler"]
