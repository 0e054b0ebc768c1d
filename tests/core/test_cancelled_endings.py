"""A cancel at any await of a guarded request's ending: the outcome is still settled, once.

``asyncio.timeout()`` around the app, a server that cancels its request tasks, or a second
cancel: each is a ``task.cancel()``, which anyio's shield lets through. Whatever await it lands
on (the acquired event's hook, the outcome's write, the task that settles a response whose app
runs on), the key ends stored or free, never held until its lock runs out; the outcome is
written and reported once. Once it is written, the cancel cuts what is left at its first
wait (a send to a client that stopped reading, a slow hook): a cancelled request ends soon,
and its retry is replayed.
"""

from __future__ import annotations

import asyncio
from asyncio import CancelledError
from collections import Counter
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyEvent, IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._record import IdempotencyRecord
from starlette_idempotency.stores.base import FencedWrite
from tests.support.asgi import post_json, post_scope
from tests.support.conditions import eventually

Message = MutableMapping[str, Any]
BODY = b'{"amount": 1}'
ROUTES = ("whole", "stream-raises", "background", "raises")


class SlowStore(MemoryStore):
    """A store whose outcome writes and releases wait: for ``gate`` (closed on demand), then
    ``turns`` turns of the loop, as a network round trip does. ``entered`` counts the calls
    made, ``written`` those that reached the records."""

    def __init__(self, turns: int = 0) -> None:
        super().__init__()
        self.turns = turns
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered: Counter[str] = Counter()
        self.written: Counter[str] = Counter()

    async def _wait(self, call: str) -> None:
        self.entered[call] += 1
        await self.gate.wait()
        for _ in range(self.turns):
            await asyncio.sleep(0)
        self.written[call] += 1

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        await self._wait("finish")
        return await super().finish(key, record, ttl)

    async def release(self, key: str, owner_token: str) -> bool:
        await self._wait("release")
        return await super().release(key, owner_token)


class Setup:
    """An app of one route per way to end, its store, and what it did."""

    def __init__(self, store_turns: int = 0) -> None:
        self.runs: Counter[str] = Counter()
        self.events: list[IdempotencyEvent] = []
        self.store = SlowStore(store_turns)
        #: The events whose hook waits, and what it waits for.
        self.holds: dict[str, asyncio.Event] = {}

        async def whole(request: Request) -> Response:
            self.runs["whole"] += 1
            return JSONResponse({"ok": 1}, status_code=201)

        async def stream_raises(request: Request) -> Response:
            self.runs["stream-raises"] += 1

            async def body() -> AsyncIterator[bytes]:
                yield b"first,"
                raise RuntimeError("the generator failed half-way")

            return StreamingResponse(body(), status_code=201)

        async def background(request: Request) -> Response:
            self.runs["background"] += 1

            async def later() -> None:
                await asyncio.sleep(0)

            return JSONResponse({"ok": 1}, status_code=201, background=BackgroundTask(later))

        async def long_background(request: Request) -> Response:
            self.runs["long-background"] += 1
            return JSONResponse(
                {"ok": 1}, status_code=201, background=BackgroundTask(asyncio.Event().wait)
            )

        async def raises(request: Request) -> Response:
            self.runs["raises"] += 1
            raise RuntimeError("the handler failed")

        async def on_event(event: IdempotencyEvent) -> None:
            self.events.append(event)
            if (hold := self.holds.get(event.result)) is not None:
                await hold.wait()

        endpoints = {
            "whole": whole,
            "stream-raises": stream_raises,
            "background": background,
            "long-background": long_background,
            "raises": raises,
        }
        self.app = Starlette(
            routes=[
                Route(f"/{name}", idempotent()(endpoint), methods=["POST"])
                for name, endpoint in endpoints.items()
            ]
        )
        self.app.add_middleware(
            IdempotencyMiddleware, store=self.store, key_scope=lambda r: "t", on_event=on_event
        )
        self.sent: list[Message] = []

    def scope(self, route: str) -> dict[str, Any]:
        headers = [(b"idempotency-key", b"k1"), (b"content-type", b"application/json")]
        scope = post_scope(f"/{route}", [*headers, (b"content-length", b"%d" % len(BODY))])
        # 2.4: a stream does not listen for http.disconnect in a task group of its own.
        return {**scope, "asgi": {"version": "3.0", "spec_version": "2.4"}}

    def start(self, route: str, *, client_reads: bool = True) -> asyncio.Task[None]:
        """The request to ``route`` in a task of its own; a client that does not read keeps
        every body chunk's send waiting, as a server's flow control does."""
        received = False

        async def receive() -> Message:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            if not client_reads and message["type"] == "http.response.body":
                await asyncio.Event().wait()
            self.sent.append(message)

        return asyncio.create_task(self.app(self.scope(route), receive, send))

    def outcomes(self) -> list[IdempotencyEvent]:
        return [event for event in self.events if event.event == "idempotency_outcome"]

    def client_got(self) -> list[tuple[str, Any]]:
        return [
            ("start", m["status"]) if m["type"] == "http.response.start" else ("body", m["body"])
            for m in self.sent
        ]

    async def retry(self, route: str) -> httpx.Response:
        return await post_json(self.app, f"/{route}", BODY, raise_app_exceptions=False)


async def loop_turns(count: int) -> None:
    """Let the loop run ``count`` turns: a cancel is delivered at its task's next step."""
    for _ in range(count):
        await asyncio.sleep(0)


async def ended(task: asyncio.Task[None]) -> BaseException | None:
    try:
        await asyncio.wait_for(asyncio.shield(task), 5)
    except BaseException as exc:  # what the request ended with is the test's to judge
        return exc
    return None


async def cancelled_during(
    setup: Setup, route: str, call: str, cancels: int = 1, *, client_reads: bool = True
) -> object:
    """What a request to ``route`` ends with, cancelled ``cancels`` times while its ending's
    ``call`` (a finish or a release) waits for the store: the ending still waits for it."""
    setup.store.gate.clear()
    running = setup.start(route, client_reads=client_reads)
    await eventually(lambda: setup.store.entered[call] == 1, message=f"the ending's {call}")
    for _ in range(cancels):
        running.cancel()
        await loop_turns(2)
    assert not running.done()
    setup.store.gate.set()
    return await ended(running)


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancel_during_the_write_of_a_whole_response_still_stores_and_sends_it(
    cancels: int,
) -> None:
    setup = Setup()
    assert isinstance(await cancelled_during(setup, "whole", "finish", cancels), CancelledError)
    # The write the cancel cut short never reached the records: the ending made it again.
    assert setup.store.written["finish"] == 1
    assert [event.result for event in setup.outcomes()] == ["COMPLETED"]
    assert setup.client_got() == [("start", 201), ("body", b'{"ok":1}')]
    replay = await setup.retry("whole")
    assert (replay.status_code, replay.headers["x-idempotent-replay"]) == (201, "true")
    assert setup.runs["whole"] == 1


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_cancel_while_an_unfinished_response_is_stored_waits_for_it(cancels: int) -> None:
    setup = Setup()
    ending = await cancelled_during(setup, "stream-raises", "finish", cancels)
    assert isinstance(ending, CancelledError)
    assert setup.store.entered["finish"] == setup.store.written["finish"] == 1
    assert [event.result for event in setup.outcomes()] == ["COMPLETED"]
    replay = await setup.retry("stream-raises")
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.headers["x-idempotent-body-omitted"] == "true"
    assert setup.runs["stream-raises"] == 1


async def test_a_cancel_while_a_handler_that_failed_frees_its_key_waits_for_it() -> None:
    setup = Setup()
    assert isinstance(await cancelled_during(setup, "raises", "release"), CancelledError)
    assert [event.result for event in setup.outcomes()] == ["RELEASED"]
    retried = await setup.retry("raises")
    assert retried.status_code == 500  # ran again: the key was free, not held for its lock TTL
    assert setup.runs["raises"] == 2


async def test_a_cancel_while_the_task_settling_for_a_running_app_waits_for_it() -> None:
    setup = Setup()
    assert isinstance(await cancelled_during(setup, "background", "finish"), CancelledError)
    assert setup.store.written["finish"] == 1
    assert [event.result for event in setup.outcomes()] == ["COMPLETED"]
    assert setup.client_got() == [("start", 201), ("body", b'{"ok":1}')]
    replay = await setup.retry("background")
    assert replay.headers["x-idempotent-replay"] == "true"
    assert setup.runs["background"] == 1


async def test_asyncio_timeout_around_the_app_still_raises_its_timeout() -> None:
    setup = Setup()
    setup.store.gate.clear()
    deadlines: list[asyncio.Timeout] = []

    async def with_deadline() -> None:
        async with asyncio.timeout(None) as deadline:
            deadlines.append(deadline)
            await setup.app(setup.scope("stream-raises"), receive, send)

    async def receive() -> Message:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: Message) -> None:
        setup.sent.append(message)

    running = asyncio.create_task(with_deadline())
    await eventually(lambda: setup.store.entered["finish"] == 1, message="the outcome's write")
    deadlines[0].reschedule(asyncio.get_running_loop().time())
    await eventually(lambda: running.cancelling() > 0, message="the deadline's cancel")
    await loop_turns(2)
    setup.store.gate.set()
    assert isinstance(await ended(running), TimeoutError)
    assert setup.store.written["finish"] == 1
    replay = await setup.retry("stream-raises")
    assert replay.headers["x-idempotent-replay"] == "true"
    assert setup.runs["stream-raises"] == 1


async def test_a_cancel_while_a_hook_takes_the_acquired_event_frees_the_key() -> None:
    setup = Setup()
    hold = setup.holds["ACQUIRED"] = asyncio.Event()
    running = setup.start("whole")
    await eventually(
        lambda: [event.result for event in setup.events] == ["ACQUIRED"],
        message="the hook taking the acquired event",
    )
    running.cancel()
    assert isinstance(await ended(running), asyncio.CancelledError)
    assert setup.runs["whole"] == 0
    assert [event.result for event in setup.outcomes()] == ["RELEASED"]
    hold.set()
    retried = await setup.retry("whole")
    assert (retried.status_code, retried.headers.get("x-idempotent-replay")) == (201, None)


async def test_a_cancel_while_a_hook_takes_the_outcome_event_writes_nothing_twice() -> None:
    setup = Setup()
    setup.holds["COMPLETED"] = asyncio.Event()
    running = setup.start("whole")
    await eventually(lambda: setup.outcomes(), message="the hook taking the outcome")
    running.cancel()
    assert isinstance(await ended(running), asyncio.CancelledError)
    assert setup.store.written["finish"] == 1
    assert [event.result for event in setup.outcomes()] == ["COMPLETED"]
    # Cancelled once its outcome was written: the rest (the hook, the client's send) is cut.
    assert setup.client_got() == []


@pytest.mark.parametrize("route", ["whole", "background"])
async def test_a_client_that_stops_reading_does_not_keep_a_cancelled_request_running(
    route: str,
) -> None:
    """Once the outcome is written, the cancel cuts the send that waits for the client: the
    request ends, and the retry is replayed."""
    setup = Setup()
    failure = await cancelled_during(setup, route, "finish", client_reads=False)
    assert isinstance(failure, CancelledError)
    assert setup.store.written["finish"] == 1
    assert setup.client_got() == [("start", 201)]  # its body's send waited, and was cut
    retry = await setup.retry(route)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert setup.runs[route] == 1


async def test_a_cancel_once_the_outcome_is_written_leaves_no_task_sending() -> None:
    """The app runs its background task, the task settling apart has written the outcome and
    waits for a client that stopped reading: cancelled, the request ends, and so does it."""
    setup = Setup()
    running = setup.start("long-background", client_reads=False)
    await eventually(lambda: setup.store.written["finish"] == 1, message="the outcome's write")
    await loop_turns(2)
    assert sending_tasks(), "the task settling apart waits for the client"
    running.cancel()
    assert isinstance(await ended(running), CancelledError)
    await loop_turns(2)
    assert not sending_tasks()


def sending_tasks() -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() if "_settle_and_send" in repr(task.get_coro())]


async def test_a_slow_outcome_hook_does_not_keep_a_cancelled_request_running() -> None:
    setup = Setup()
    setup.holds["COMPLETED"] = asyncio.Event()  # never set
    assert isinstance(await cancelled_during(setup, "whole", "finish"), CancelledError)
    assert setup.store.written["finish"] == 1


async def test_the_apps_own_error_stays_in_the_story_of_a_cancelled_ending() -> None:
    """The app raised, and a cancel came while its ending stored what it had sent: the cancel
    is raised with the app's error as its context, for the server's log to show both."""
    setup = Setup()
    setup.store.gate.clear()
    raised: list[BaseException] = []

    async def server() -> None:  # what a server's task sees, and logs
        try:
            await setup.start("stream-raises")
        except BaseException as exc:
            raised.append(exc)
            raise

    running = asyncio.create_task(server())
    await eventually(lambda: setup.store.entered["finish"] == 1, message="the outcome's write")
    running.cancel()
    await loop_turns(2)
    setup.store.gate.set()
    assert isinstance(await ended(running), CancelledError)
    [failure] = raised
    assert isinstance(failure, CancelledError)
    assert not failure.__suppress_context__
    assert isinstance(failure.__context__, RuntimeError)
    assert str(failure.__context__) == "the generator failed half-way"


@settings(max_examples=120, deadline=None)
@given(
    route=st.sampled_from(ROUTES),
    store_turns=st.integers(0, 4),
    turns_before=st.integers(0, 30),
    second_after=st.none() | st.integers(0, 6),
)
def test_a_cancel_at_any_turn_leaves_the_key_stored_or_free(
    route: str, store_turns: int, turns_before: int, second_after: int | None
) -> None:
    """Cancelled (once or twice) after any number of loop turns: never held, written at most
    once, reported at most once, and a stored outcome is what a retry gets."""

    async def scenario() -> None:
        setup = Setup(store_turns)
        running = setup.start(route)
        await loop_turns(turns_before)
        running.cancel()
        if second_after is not None:
            await loop_turns(second_after)
            running.cancel()
        await ended(running)  # its ending waited for whatever settled beside the app
        writes = setup.store.written["finish"] + setup.store.written["release"]
        assert writes <= 1, setup.store.written
        assert len(setup.outcomes()) <= 1, setup.outcomes()
        ran = setup.runs[route]
        retried = await setup.retry(route)
        assert retried.status_code != 409, "the key was left held"
        if retried.headers.get("x-idempotent-replay") == "true":
            assert ran == setup.runs[route] == 1
            assert setup.store.written["finish"] == 1

    asyncio.run(scenario())
