"""A response's last chunk goes out once its outcome is stored: after the app has returned
(its frames gone while the store answers), or, while the app runs on (background tasks),
apart from it, so that the client never waits for them; a stream's, once its app returned.
The start of a response of a declared length goes out with its first chunk, so one of one
chunk reaches the server whole, once stored; a stream's goes out as the app sends it."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency._types import ASGIApp, Message, Receive, Scope, Send
from starlette_idempotency.stores.base import FencedWrite
from tests.support.conditions import eventually, eventually_sync
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


def server_side(app: ASGIApp, sent: list[str]) -> ASGIApp:
    """``app``, noting in ``sent`` each message that reaches the server (the ASGI message's
    type, without its ``http.response.`` prefix)."""

    async def noted(scope: Scope, receive: Receive, send: Send) -> None:
        async def send_noted(message: Message) -> None:
            sent.append(message["type"].removeprefix("http.response."))
            await send(message)

        await app(scope, receive, send_noted)

    return noted


async def test_a_response_of_one_chunk_reaches_the_server_whole_once_stored() -> None:
    """Its start is held with its body: the server gets the two back to back (a client woken
    by the headers alone would be woken again for the body)."""
    done: list[str] = []
    store = WatchedStore(done)
    guarded = IdempotencyMiddleware(paying_app(done), store=store, key_scope=lambda r: "t")
    first = await make_client(server_side(guarded, done)).post(
        "/pay", headers={"Idempotency-Key": uuid.uuid4().hex}
    )
    assert (first.status_code, first.content) == (201, b'{"paid":1}')
    assert store.seen_at_finish == [["returned"]]  # nothing had reached the server
    assert done == ["returned", "start", "body"]


async def test_a_response_without_a_body_reaches_the_server_whole_once_stored() -> None:
    """A 204 (a PATCH's usual answer) declares no length, and has no body to wait for."""
    done: list[str] = []
    store = WatchedStore(done)

    @idempotent()
    async def update(request: Request) -> Response:
        return Response(status_code=204)

    app = Starlette(routes=[Route("/update", update, methods=["PATCH"])])
    guarded = IdempotencyMiddleware(app, store=store, key_scope=lambda r: "t")
    answered = await make_client(server_side(guarded, done)).patch(
        "/update", headers={"Idempotency-Key": uuid.uuid4().hex}
    )
    assert answered.status_code == 204
    assert store.seen_at_finish == [[]]  # nothing had reached the server
    assert done == ["start", "body"]


async def test_a_streamed_response_is_not_held_back() -> None:
    """A response of no declared length (a stream) sends its start and each chunk but the last
    as the app sends them, while it runs."""
    done: list[str] = []
    store = WatchedStore(done)

    async def chunks() -> AsyncIterator[bytes]:
        done.append("app: first chunk")
        yield b"one,"
        done.append("app: second chunk")
        yield b"two"

    @idempotent()
    async def report(request: Request) -> Response:
        return StreamingResponse(chunks(), status_code=201)

    app = Starlette(routes=[Route("/report", report, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, store=store, key_scope=lambda r: "t")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = await make_client(server_side(guarded, done)).post("/report", headers=headers)
    assert (first.status_code, first.content) == (201, b"one,two")
    sent_while_running = ["start", "app: first chunk", "body", "app: second chunk", "body"]
    # Stored before the last (empty) chunk that ends a StreamingResponse went out.
    assert store.seen_at_finish == [sent_while_running]
    assert done == [*sent_while_running, "body"]
    retry = await make_client(guarded).post("/report", headers=headers)
    assert (retry.headers["x-idempotent-replay"], retry.content) == ("true", b"one,two")


def test_a_stream_waiting_for_its_first_chunk_has_sent_its_headers() -> None:
    """Through uvicorn: a client gets a stream's headers while the app has yet to send any of
    its body (server-sent events, a long poll), and the rest once it does."""
    go_on = threading.Event()

    async def later() -> AsyncIterator[bytes]:
        await asyncio.to_thread(go_on.wait, 10)
        yield b"event"

    @idempotent()
    async def events(request: Request) -> Response:
        return StreamingResponse(later(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/events", events, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: "t")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with uvicorn_thread(guarded) as url, httpx.Client(base_url=url, timeout=5) as client:
        try:
            with client.stream("POST", "/events", headers=headers) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                go_on.set()
                assert response.read() == b"event"
        finally:
            go_on.set()


async def test_a_start_without_its_body_still_reaches_the_client() -> None:
    """An app that starts a response of a declared length (held) and raises before its body:
    the start goes out as the app sent it, so the server's error middleware sees a response
    begun (and cuts it short) rather than answering 500 in its place."""

    async def starts_then_fails(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"10")]
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        raise RuntimeError("after the start")

    @idempotent()
    async def pay(request: Request) -> Response:
        return Response()  # never used: the route's app below answers

    route = Route("/pay", pay, methods=["POST"])
    route.app = starts_then_fails
    app = Starlette(
        routes=[route],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
        ],
    )
    answered = await make_client(app, raise_app_exceptions=False).post(
        "/pay", headers={"Idempotency-Key": uuid.uuid4().hex}
    )
    assert answered.status_code == 202


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


class Passing(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        return await call_next(request)


def streaming_app(
    runs: list[str], background: BackgroundTask | None = None, **policy: Any
) -> Starlette:
    """``POST /export``, a stream whose generator breaks off after its first chunk when asked
    (``?broken``), of a declared length when asked (``?declared``), behind a
    BaseHTTPMiddleware inside the guard."""

    @idempotent(**policy)
    async def export(request: Request) -> Response:
        runs.append("handler")

        async def rows() -> AsyncIterator[bytes]:
            yield b'{"rows": [1, 2'
            if "broken" in request.query_params:
                raise RuntimeError("the database went away mid-stream")
            yield b"]}"

        declared = {"content-length": "16"} if "declared" in request.query_params else None
        return StreamingResponse(
            rows(), 201, declared, media_type="application/json", background=background
        )

    return Starlette(
        routes=[Route("/export", export, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t"),
            Middleware(Passing),
        ],
    )


@pytest.mark.parametrize("declared", [False, True], ids=["stream", "declared length"])
@pytest.mark.parametrize("broken", [False, True], ids=["whole", "broken off"])
async def test_a_stream_ended_before_its_app_raised_is_never_replayed_as_whole(
    broken: bool, declared: bool
) -> None:
    """Starlette's BaseHTTPMiddleware ends a stream its app broke off, and raises the app's
    error a turn of the loop later: a stream is stored without its body until its app has
    returned, and a response shorter than its declared length without it at all."""
    runs: list[str] = []
    client = make_client(streaming_app(runs), raise_app_exceptions=False)
    url = "/export?" + "&".join(q for q, on in (("broken", broken), ("declared", declared)) if on)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    await client.post(url, headers=headers)
    retry = await client.post(url, headers=headers)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.status_code == 201
    if broken:
        assert (retry.headers["x-idempotent-body-omitted"], retry.content) == ("true", b"")
    else:
        assert retry.json() == {"rows": [1, 2]}
    assert runs == ["handler"]


async def test_a_stream_keeps_its_lock_while_its_background_task_runs() -> None:
    """A stream's outcome waits for its app, background tasks included, and its lock is
    renewed meanwhile, past its TTL: a retry then is answered 409, never run again, and once
    the app has returned, replayed whole."""
    runs: list[str] = []
    release = asyncio.Event()
    app = streaming_app(runs, BackgroundTask(release.wait), lock_ttl_seconds=0.1)
    client = make_client(app)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = asyncio.create_task(client.post("/export", headers=headers))
    await eventually(lambda: runs, message="the handler to run")
    await asyncio.sleep(0.3)  # three times the lock's TTL, the background task still waiting
    during = await client.post("/export", headers=headers)
    release.set()
    assert (await first).json() == {"rows": [1, 2]}
    after = await client.post("/export", headers=headers)
    assert during.status_code == 409
    assert (after.headers["x-idempotent-replay"], after.json()) == ("true", {"rows": [1, 2]})
    assert runs == ["handler"]
