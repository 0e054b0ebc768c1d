"""The client transports against scripted answers (``httpx.MockTransport``), sync and async.

A fake clock advances only when the transport sleeps (or a script step says so), so backoff,
``Retry-After`` and the deadline are checked exactly and nothing really waits.
"""

from __future__ import annotations

import email.utils
import gzip
import json
import random
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from starlette_idempotency.client import (
    DEFAULT_RETRY_STATUSES,
    AsyncIdempotentTransport,
    IdempotentTransport,
    NonReplayableRequestError,
    RetryPolicy,
    parse_retry_after,
)
from starlette_idempotency.testing import FakeClock

URL = "http://api.test/payments"
Step = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class Script:
    """A MockTransport handler that answers each attempt with the next step."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.keys: list[str | None] = []
        self.bodies: list[bytes] = []
        self.methods: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers.get("Idempotency-Key"))
        self.bodies.append(request.read())
        self.methods.append(request.method)
        if not self.steps:
            raise AssertionError(f"unexpected attempt {len(self.keys)}")
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        if isinstance(step, httpx.Response):
            return step
        return step(request)

    @property
    def attempts(self) -> int:
        return len(self.keys)


class TrackedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that is not in memory: yields chunks, maybe fails, records close()."""

    def __init__(self, *chunks: bytes, error: Exception | None = None) -> None:
        self.chunks = chunks
        self.error = error
        self.consumed = False
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks
        self.consumed = True
        if self.error is not None:
            raise self.error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        self.consumed = True
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def status(code: int, **headers: str) -> httpx.Response:
    return httpx.Response(code, headers=headers, json={"status": code})


def replay(code: int, header: str = "X-Idempotent-Replay") -> httpx.Response:
    return httpx.Response(code, headers={header: "true"}, json={"stored": code})


@dataclass
class Rig:
    """Sends one request through a sync or an async transport over a Script."""

    mode: str
    clock: FakeClock = field(default_factory=FakeClock)
    sleeps: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def configure(self, **options: Any) -> Rig:
        self.options.update(options)
        return self

    def stream(self, chunk: bytes) -> Iterator[bytes] | AsyncIterator[bytes]:
        """A body of one ``chunk`` that can be read only once, sync or async as the rig is."""

        def chunks() -> Iterator[bytes]:
            yield chunk

        async def async_chunks() -> AsyncIterator[bytes]:
            yield chunk

        return chunks() if self.mode == "sync" else async_chunks()

    def _sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.advance(seconds)

    async def _async_sleep(self, seconds: float) -> None:
        self._sleep(seconds)

    async def send(
        self,
        script: Script,
        method: str = "POST",
        url: str = URL,
        *,
        auth: httpx.Auth | None = None,
        follow_redirects: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        options: dict[str, Any] = {"rng": lambda: 0.0, "clock": self.clock, **self.options}
        mock = httpx.MockTransport(script)
        if self.mode == "sync":
            transport = IdempotentTransport(mock, sleep=self._sleep, **options)
            request = httpx.Request(method, url, **kwargs)
            return _send_sync(transport, request, auth=auth, follow_redirects=follow_redirects)
        async_transport = AsyncIdempotentTransport(mock, sleep=self._async_sleep, **options)
        async with httpx.AsyncClient(transport=async_transport) as async_client:
            return await async_client.request(
                method, url, auth=auth, follow_redirects=follow_redirects, **kwargs
            )


def _send_sync(
    transport: httpx.BaseTransport,
    request: httpx.Request,
    *,
    auth: httpx.Auth | None = None,
    follow_redirects: bool = False,
) -> httpx.Response:
    # MockTransport answers at once: a sync client inside an async test blocks nothing.
    with httpx.Client(transport=transport) as client:
        return client.send(request, auth=auth, follow_redirects=follow_redirects)


class SendAgain(httpx.Auth):
    """Sends the same request object twice, as a token refresh or DigestAuth does after a 401."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        yield request
        yield request


@pytest.fixture(params=["sync", "async"])
def rig(request: pytest.FixtureRequest) -> Rig:
    return Rig(mode=str(request.param))


# --- the key ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_adds_a_uuid4_key(rig: Rig, method: str) -> None:
    script = Script(status(201))
    response = await rig.send(script, method, json={"amount": 10})
    key = script.keys[0]
    assert key is not None
    assert uuid.UUID(key).version == 4
    assert response.request.headers["Idempotency-Key"] == key


async def test_each_request_gets_its_own_key(rig: Rig) -> None:
    script = Script(status(201), status(201))
    await rig.send(script, json={})
    await rig.send(script, json={})
    assert script.keys[0] != script.keys[1]


async def test_keeps_the_callers_key(rig: Rig) -> None:
    script = Script(status(503), status(201))
    await rig.send(script, json={}, headers={"idempotency-key": "order-42"})
    assert script.keys == ["order-42", "order-42"]


@pytest.mark.parametrize(
    "location",
    [
        "/v2/payments",
        "http://elsewhere.test/payments",
        "https://api.test/payments",
        "http://api.test:8080/payments",
    ],
    ids=["same-origin", "other-host", "other-scheme", "other-port"],
)
async def test_a_redirect_gets_a_new_key(rig: Rig, location: str) -> None:
    script = Script(httpx.Response(308, headers={"Location": location}), status(201))
    response = await rig.send(script, json={}, follow_redirects=True)
    first, second = script.keys
    assert response.status_code == 201
    assert first is not None
    assert second is not None
    assert second != first
    assert response.request.headers["Idempotency-Key"] == second


@pytest.mark.parametrize("code", [301, 302, 303])
async def test_a_redirect_to_a_get_carries_no_key(rig: Rig, code: int) -> None:
    script = Script(httpx.Response(code, headers={"Location": "/receipts/1"}), status(200))
    await rig.send(script, json={}, follow_redirects=True)
    assert script.methods == ["POST", "GET"]
    assert script.keys[0] is not None
    assert script.keys[1] is None


async def test_the_callers_key_follows_a_redirect(rig: Rig) -> None:
    script = Script(httpx.Response(308, headers={"Location": "/v2/payments"}), status(201))
    await rig.send(script, json={}, headers={"idempotency-key": "order-42"}, follow_redirects=True)
    assert script.keys == ["order-42", "order-42"]


@pytest.mark.parametrize("code", [400, 401, 403, 422])
async def test_sent_again_after_an_answer_that_needs_a_new_key_gets_one(
    rig: Rig, code: int
) -> None:
    script = Script(status(code), status(201))
    response = await rig.send(script, json={}, auth=SendAgain())
    first, second = script.keys
    assert first is not None
    assert second is not None
    assert second != first
    assert response.request.headers["Idempotency-Key"] == second


@pytest.mark.parametrize("code", [400, 401, 403, 422])
async def test_sent_again_after_a_lost_answer_then_a_401_keeps_its_key(rig: Rig, code: int) -> None:
    """The first attempt's answer was lost (it may have run the handler); the retry met an
    auth layer's 401 (a token expired meanwhile). A new key on the refreshed request ran the
    handler a second time; the same key gets the stored answer."""
    script = Script(httpx.ReadError("reset"), status(code), status(201))
    await rig.send(script, json={}, auth=SendAgain())
    assert script.keys[0] is not None
    assert script.keys == [script.keys[0]] * 3


@pytest.mark.parametrize(
    "unsent",
    [httpx.ConnectError("refused"), httpx.ConnectTimeout("slow"), httpx.PoolTimeout("full")],
    ids=lambda error: type(error).__name__,
)
async def test_sent_again_after_an_unsent_attempt_then_a_401_gets_a_new_key(
    rig: Rig, unsent: Exception
) -> None:
    """The first attempt never left (no connection): the 401 answered the first attempt that
    reached the server, and the handler's 401 is stored under the key."""
    script = Script(unsent, status(401), status(201))
    await rig.send(script, json={}, auth=SendAgain())
    first, second, third = script.keys
    assert first == second
    assert third is not None
    assert third != first


@pytest.mark.parametrize("code", [201, 202, 404, 409])
async def test_sent_again_after_another_final_answer_keeps_its_key(rig: Rig, code: int) -> None:
    script = Script(status(code), status(201))
    await rig.send(script, json={}, auth=SendAgain())
    assert script.keys[0] is not None
    assert script.keys[1] == script.keys[0]


async def test_the_callers_key_is_sent_again_after_a_401(rig: Rig) -> None:
    script = Script(status(401), status(201))
    await rig.send(script, json={}, headers={"idempotency-key": "order-42"}, auth=SendAgain())
    assert script.keys == ["order-42", "order-42"]


async def test_custom_header_name(rig: Rig) -> None:
    rig.configure(header_name="X-Request-Key")
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("X-Request-Key"))
        return status(201)

    script = Script(answer)
    await rig.send(script, json={})
    assert script.keys == [None]
    assert seen[0] is not None
    assert uuid.UUID(seen[0]).version == 4


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "HEAD", "OPTIONS"])
async def test_other_methods_are_sent_once_untouched(rig: Rig, method: str) -> None:
    script = Script(status(503, **{"Retry-After": "1"}))
    response = await rig.send(script, method)
    assert response.status_code == 503
    assert script.keys == [None]
    assert rig.sleeps == []


async def test_other_methods_may_stream_their_body(rig: Rig) -> None:
    script = Script(status(200))
    content = rig.stream(b"streamed")
    response = await rig.send(script, "PUT", content=content)
    assert response.status_code == 200
    assert script.bodies == [b"streamed"]


# --- what is retried -------------------------------------------------------------------------


async def test_same_key_and_same_body_on_every_attempt(rig: Rig) -> None:
    script = Script(
        httpx.ConnectError("refused"), status(503), httpx.ReadTimeout("slow"), status(201)
    )
    response = await rig.send(script, json={"amount": "10.00", "note": "é"})
    assert response.status_code == 201
    assert script.attempts == 4
    assert len(set(script.keys)) == 1
    # the bytes of the first attempt, whatever httpx's JSON encoder makes of the payload
    assert json.loads(script.bodies[0]) == {"amount": "10.00", "note": "é"}
    assert script.bodies == [script.bodies[0]] * 4


@pytest.mark.parametrize(
    "body",
    [
        {"content": bytes(range(256))},
        {"content": "text body"},
        {"data": {"a": "1", "b": "2"}},
        {"files": {"upload": ("a.bin", b"\x00\x01binary")}},
    ],
    ids=["bytes", "str", "form", "multipart"],
)
async def test_every_in_memory_body_is_resent_byte_for_byte(rig: Rig, body: dict[str, Any]) -> None:
    script = Script(status(502), status(504), status(200))
    await rig.send(script, **body)
    assert script.attempts == 3
    assert script.bodies[0]
    assert script.bodies == [script.bodies[0]] * 3


@pytest.mark.parametrize("code", [429, 500, 502, 503, 504])
async def test_retry_statuses_are_retried(rig: Rig, code: int) -> None:
    script = Script(status(code), status(201))
    response = await rig.send(script, json={})
    assert response.status_code == 201
    assert script.attempts == 2
    assert rig.sleeps == [0.5]


async def test_409_with_retry_after_is_waited_out(rig: Rig) -> None:
    script = Script(status(409, **{"Retry-After": "2"}), replay(201))
    response = await rig.send(script, json={})
    assert response.status_code == 201
    assert response.headers["X-Idempotent-Replay"] == "true"
    assert rig.sleeps == [2.0]


@pytest.mark.parametrize("code", [400, 401, 403, 422])
async def test_statuses_that_need_a_new_key_are_never_retried(rig: Rig, code: int) -> None:
    script = Script(status(code, **{"Retry-After": "1"}))
    response = await rig.send(script, json={})
    assert response.status_code == code
    assert script.attempts == 1


@pytest.mark.parametrize("code", [200, 201, 204, 302, 404, 405, 413, 501, 505])
async def test_other_statuses_are_final(rig: Rig, code: int) -> None:
    script = Script(httpx.Response(code))
    response = await rig.send(script, json={})
    assert response.status_code == code
    assert script.attempts == 1


@pytest.mark.parametrize("header", ["X-Idempotent-Replay", "Idempotent-Replayed"])
@pytest.mark.parametrize("code", [201, 409, 500, 503])
async def test_a_replay_is_final_whatever_its_status(rig: Rig, code: int, header: str) -> None:
    script = Script(replay(code, header))
    response = await rig.send(script, json={})
    assert response.status_code == code
    assert response.json() == {"stored": code}
    assert script.attempts == 1


@pytest.mark.parametrize("retry_after", [None, "later"])
async def test_409_without_a_usable_retry_after_is_final(rig: Rig, retry_after: str | None) -> None:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    script = Script(status(409, **headers))
    response = await rig.send(script, json={})
    assert response.status_code == 409
    assert script.attempts == 1


async def test_retry_statuses_can_be_narrowed(rig: Rig) -> None:
    rig.configure(retry_statuses=[503])
    script = Script(status(503), status(500))
    response = await rig.send(script, json={})
    assert response.status_code == 500
    assert script.attempts == 2


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("refused"),
        httpx.ConnectTimeout("slow connect"),
        httpx.ReadTimeout("slow read"),
        httpx.WriteTimeout("slow write"),
        httpx.PoolTimeout("pool full"),
        httpx.ReadError("reset"),
        httpx.WriteError("broken pipe"),
        httpx.RemoteProtocolError("Server disconnected without sending a response."),
        httpx.ProxyError("proxy hiccup"),
    ],
    ids=lambda error: type(error).__name__,
)
async def test_transport_errors_are_retried(rig: Rig, error: Exception) -> None:
    script = Script(error, status(201))
    response = await rig.send(script, json={})
    assert response.status_code == 201
    assert script.attempts == 2
    assert script.keys[0] == script.keys[1]


@pytest.mark.parametrize(
    "error",
    [httpx.UnsupportedProtocol("ftp"), httpx.LocalProtocolError("bad header"), RuntimeError("x")],
    ids=lambda error: type(error).__name__,
)
async def test_errors_made_on_this_side_are_not_retried(rig: Rig, error: Exception) -> None:
    script = Script(error)
    with pytest.raises(type(error)):
        await rig.send(script, json={})
    assert script.attempts == 1


async def test_a_reply_cut_short_in_the_body_is_retried(rig: Rig) -> None:
    cut = TrackedStream(b'{"partial', error=httpx.RemoteProtocolError("peer closed connection"))
    script = Script(httpx.Response(201, stream=cut), replay(201))
    response = await rig.send(script, json={})
    assert response.json() == {"stored": 201}
    assert script.attempts == 2
    assert cut.closed


async def test_discarded_responses_are_read_and_closed(rig: Rig) -> None:
    first = TrackedStream(b"busy")
    final = TrackedStream(b'{"ok": ', b"true}")
    script = Script(httpx.Response(503, stream=first), httpx.Response(200, stream=final))
    response = await rig.send(script, json={})
    assert first.consumed
    assert first.closed
    assert response.json() == {"ok": True}
    assert final.closed


async def test_a_streamed_response_keeps_its_encoding(rig: Rig) -> None:
    body = TrackedStream(gzip.compress(b"hello, world"))
    script = Script(httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=body))
    response = await rig.send(script, json={})
    assert response.text == "hello, world"
    assert response.elapsed.total_seconds() >= 0


# --- Retry-After, backoff, limits ------------------------------------------------------------


async def test_retry_after_seconds_are_honoured(rig: Rig) -> None:
    script = Script(status(503, **{"Retry-After": "3"}), status(429, **{"Retry-After": "0"}))
    script.steps.append(status(201))
    await rig.send(script, json={})
    # "0" is a floor too: the second retry still waits its own backoff (1 s).
    assert rig.sleeps == [3.0, 1.0]


async def test_retry_after_http_date_is_honoured(rig: Rig) -> None:
    when = email.utils.formatdate(rig.clock.now + 7, usegmt=True)
    script = Script(status(503, **{"Retry-After": when}), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == [7.0]


async def test_retry_after_is_not_shortened_by_backoff_cap(rig: Rig) -> None:
    rig.configure(backoff_cap=5.0)
    script = Script(status(429, **{"Retry-After": "45"}), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == [45.0]


async def test_retry_after_shorter_than_the_backoff_waits_the_backoff(rig: Rig) -> None:
    draws = iter([0.5, 0.5])
    rig.configure(backoff_base=2.0, rng=lambda: next(draws))
    script = Script(status(409, **{"Retry-After": "1"}), status(409, **{"Retry-After": "5"}))
    script.steps.append(replay(201))
    await rig.send(script, json={})
    assert rig.sleeps == [3.0, 6.0]  # backoff 2 + 1 jitter beats 1; 4 + 2 jitter beats 5


@pytest.mark.parametrize("code", [409, 429, 503])
async def test_retry_after_above_max_retry_after_is_returned_at_once(rig: Rig, code: int) -> None:
    script = Script(status(code, **{"Retry-After": "61"}))
    response = await rig.send(script, json={})
    assert response.status_code == code
    assert response.headers["Retry-After"] == "61"
    assert script.attempts == 1
    assert rig.sleeps == []


async def test_max_retry_after_is_inclusive_and_configurable(rig: Rig) -> None:
    rig.configure(max_retry_after=10.0)
    script = Script(status(503, **{"Retry-After": "10"}), status(503, **{"Retry-After": "11"}))
    response = await rig.send(script, json={})
    assert response.headers["Retry-After"] == "11"
    assert script.attempts == 2
    assert rig.sleeps == [10.0]


async def test_a_far_retry_after_date_is_returned_at_once(rig: Rig) -> None:
    when = email.utils.formatdate(rig.clock.now + 3600, usegmt=True)
    script = Script(status(503, **{"Retry-After": when}))
    await rig.send(script, json={})
    assert script.attempts == 1
    assert rig.sleeps == []


async def test_unreadable_retry_after_falls_back_to_backoff(rig: Rig) -> None:
    script = Script(status(503, **{"Retry-After": "soon"}), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == [0.5]


async def test_backoff_doubles_and_is_capped(rig: Rig) -> None:
    rig.configure(backoff_base=1.0, backoff_cap=10.0, max_attempts=7)
    script = Script(*(status(503) for _ in range(6)), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


async def test_jitter_adds_up_to_one_more_backoff(rig: Rig) -> None:
    draws = iter([0.5, 0.25, 0.999])
    rig.configure(backoff_base=1.0, rng=lambda: next(draws))
    script = Script(status(503), status(503), status(503), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == pytest.approx([1.5, 2.5, 7.996])


async def test_max_attempts_then_the_last_response(rig: Rig) -> None:
    rig.configure(max_attempts=3)
    script = Script(status(503), status(502), status(504))
    response = await rig.send(script, json={})
    assert response.status_code == 504
    assert script.attempts == 3
    assert rig.sleeps == [0.5, 1.0]


async def test_max_attempts_of_one_never_retries(rig: Rig) -> None:
    rig.configure(max_attempts=1)
    script = Script(status(503))
    assert (await rig.send(script, json={})).status_code == 503
    assert rig.sleeps == []


async def test_max_attempts_then_the_last_error_is_raised(rig: Rig) -> None:
    rig.configure(max_attempts=3)
    last = httpx.ReadError("third")
    script = Script(httpx.ConnectError("first"), status(503), last)
    with pytest.raises(httpx.ReadError) as raised:
        await rig.send(script, json={})
    assert raised.value is last
    assert script.attempts == 3
    assert any("gave up after 3 attempts" in note for note in raised.value.__notes__)


async def test_deadline_stops_before_a_wait_that_would_pass_it(rig: Rig) -> None:
    rig.configure(backoff_base=1.0, deadline=10.0, max_attempts=10)
    script = Script(*(status(503) for _ in range(10)))
    response = await rig.send(script, json={})
    # Waits 1, 2 and 4 end at 7 s; the next one (8 s) would end at 15 s.
    assert rig.sleeps == [1.0, 2.0, 4.0]
    assert script.attempts == 4
    assert response.status_code == 503


async def test_deadline_may_be_reached_exactly(rig: Rig) -> None:
    rig.configure(backoff_base=1.0, deadline=3.0)
    script = Script(status(503), status(503), status(201))
    assert (await rig.send(script, json={})).status_code == 201
    assert rig.sleeps == [1.0, 2.0]


async def test_deadline_counts_the_time_attempts_take(rig: Rig) -> None:
    rig.configure(backoff_base=1.0, deadline=10.0)

    def slow(request: httpx.Request) -> httpx.Response:
        rig.clock.advance(4.0)
        raise httpx.ReadTimeout("slow", request=request)

    script = Script(slow, slow, slow)
    with pytest.raises(httpx.ReadTimeout):
        await rig.send(script, json={})
    # Attempt 1 ends at 4 s, +1 s wait; attempt 2 ends at 9 s, +2 s would pass 10 s.
    assert script.attempts == 2
    assert rig.sleeps == [1.0]


@pytest.mark.parametrize("step", [-3600.0, 3600.0], ids=["back", "forward"])
async def test_deadline_ignores_a_stepped_wall_clock(rig: Rig, step: float) -> None:
    rig.configure(backoff_base=1.0, deadline=10.0, max_attempts=10)

    def stepped(request: httpx.Request) -> httpx.Response:
        rig.clock.jump(step)
        return status(503)

    script = Script(stepped, *(status(503) for _ in range(9)))
    await rig.send(script, json={})
    assert rig.sleeps == [1.0, 2.0, 4.0]
    assert script.attempts == 4


async def test_a_retry_after_past_the_deadline_is_returned_at_once(rig: Rig) -> None:
    rig.configure(deadline=10.0)
    script = Script(status(503, **{"Retry-After": "30"}))
    response = await rig.send(script, json={})
    assert response.status_code == 503
    assert script.attempts == 1
    assert rig.sleeps == []


async def test_a_retry_after_is_waited_up_to_the_deadline_exactly(rig: Rig) -> None:
    rig.configure(deadline=4.0)
    script = Script(status(409, **{"Retry-After": "4"}), replay(201))
    response = await rig.send(script, json={})
    assert response.status_code == 201
    assert rig.sleeps == [4.0]


# --- bodies that cannot be replayed ----------------------------------------------------------


async def test_streaming_body_is_refused_up_front(rig: Rig) -> None:
    script = Script(status(201))
    content = rig.stream(b"once")
    with pytest.raises(NonReplayableRequestError, match="pass the body as bytes") as raised:
        await rig.send(script, content=content)
    assert script.attempts == 0
    assert isinstance(raised.value, httpx.RequestError)
    assert raised.value.request.url == URL


async def test_a_body_read_beforehand_is_accepted(rig: Rig) -> None:
    request = httpx.Request("POST", URL, content=iter([b"a", b"b"]))
    request.read()
    script = Script(status(503), status(201))
    options: dict[str, Any] = {"rng": lambda: 0.0, "sleep": lambda _: None}
    if rig.mode == "sync":
        _send_sync(IdempotentTransport(httpx.MockTransport(script), **options), request)
    else:
        options["sleep"] = _no_wait
        transport = AsyncIdempotentTransport(httpx.MockTransport(script), **options)
        async with httpx.AsyncClient(transport=transport) as client:
            await client.send(request)
    assert script.bodies == [b"ab", b"ab"]


async def _no_wait(seconds: float) -> None:
    return None


async def test_a_seeded_random_drives_the_jitter(rig: Rig) -> None:
    rig.configure(backoff_base=1.0, rng=random.Random(7))
    expected = random.Random(7)
    script = Script(status(503), status(503), status(201))
    await rig.send(script, json={})
    assert rig.sleeps == [1.0 + expected.random(), 2.0 + 2.0 * expected.random()]


async def test_the_async_transport_accepts_a_plain_sleep() -> None:
    sleeps: list[float] = []
    script = Script(status(503), status(201))
    transport = AsyncIdempotentTransport(
        httpx.MockTransport(script), sleep=sleeps.append, rng=lambda: 0.0
    )
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post(URL, json={})
    assert response.status_code == 201
    assert sleeps == [0.5]


# --- construction and lifetime ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [IdempotentTransport, AsyncIdempotentTransport])
@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 2.5),
        ("max_attempts", True),
        ("backoff_base", -0.1),
        ("backoff_base", float("nan")),
        ("backoff_base", "1"),
        ("backoff_cap", -1),
        ("backoff_cap", float("inf")),
        ("max_retry_after", -1),
        ("max_retry_after", float("nan")),
        ("max_retry_after", "60"),
        ("deadline", 0),
        ("deadline", -5),
        ("retry_statuses", (200, 503)),
        ("retry_statuses", (503, 422)),
        ("retry_statuses", (400,)),
        ("retry_statuses", "503"),
        ("retry_statuses", (600,)),
        ("header_name", ""),
        ("header_name", "Idempotency Key"),
        ("header_name", "Key:"),
        ("header_name", "Key\n"),
    ],
)
def test_invalid_options_are_refused(cls: type[Any], option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        cls(httpx.MockTransport(lambda request: status(200)), **{option: value})


def test_defaults() -> None:
    sync = IdempotentTransport()
    assert isinstance(sync.transport, httpx.HTTPTransport)
    assert sync.header_name == "Idempotency-Key"
    assert sync.policy == RetryPolicy()
    assert sync.policy.retry_statuses == frozenset({409, 429, 500, 502, 503, 504})
    assert sync.policy.retry_statuses == frozenset(DEFAULT_RETRY_STATUSES)
    assert (sync.policy.max_attempts, sync.policy.backoff_base) == (5, 0.5)
    assert (sync.policy.backoff_cap, sync.policy.deadline) == (30.0, None)
    assert sync.policy.max_retry_after == 60.0
    sync.close()
    assert isinstance(AsyncIdempotentTransport().transport, httpx.AsyncHTTPTransport)


def test_a_transport_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(TypeError, match="AsyncBaseTransport"):
        AsyncIdempotentTransport(httpx.HTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="BaseTransport"):
        IdempotentTransport(httpx.AsyncHTTPTransport())  # type: ignore[arg-type]


class ClosingSpy(httpx.BaseTransport, httpx.AsyncBaseTransport):
    def __init__(self) -> None:
        self.closed = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return status(200)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return status(200)

    def close(self) -> None:
        self.closed += 1

    async def aclose(self) -> None:
        self.closed += 1


def test_close_is_forwarded() -> None:
    spy = ClosingSpy()
    with httpx.Client(transport=IdempotentTransport(spy)) as client:
        client.post(URL, json={})
    assert spy.closed == 1


async def test_aclose_is_forwarded() -> None:
    spy = ClosingSpy()
    async with httpx.AsyncClient(transport=AsyncIdempotentTransport(spy)) as client:
        await client.post(URL, json={})
    assert spy.closed == 1


# --- the shared policy and the Retry-After parser --------------------------------------------


def test_backoff_formula() -> None:
    policy = RetryPolicy(backoff_base=0.5, backoff_cap=30.0)
    assert [policy.backoff(n, lambda: 0.0) for n in range(8)] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0
    ]  # fmt: skip
    assert policy.backoff(2, lambda: 0.5) == 3.0
    assert policy.backoff(10_000, lambda: 0.9) == 30.0


def test_backoff_jitter_stays_in_range() -> None:
    policy = RetryPolicy(backoff_base=0.25, backoff_cap=1000.0)
    for retry in range(6):
        base = 0.25 * 2**retry
        for _ in range(50):
            assert base <= policy.backoff(retry) < 2 * base


def test_policy_needs_a_response_or_an_error() -> None:
    with pytest.raises(TypeError):
        RetryPolicy().next_delay(attempts=1, elapsed=0.0)


def test_policy_decisions() -> None:
    policy = RetryPolicy(max_attempts=3, backoff_base=1.0)

    def decide(attempts: int, **outcome: Any) -> float | None:
        return policy.next_delay(
            attempts=attempts, elapsed=0.0, rng=lambda: 0.0, now=0.0, **outcome
        )

    assert decide(1, response=status(503)) == 1.0
    assert decide(2, response=status(503)) == 2.0
    assert decide(3, response=status(503)) is None
    assert decide(1, response=replay(503)) is None
    assert decide(1, response=status(409, **{"Retry-After": "4"})) == 4.0
    assert decide(2, response=status(409, **{"Retry-After": "1"})) == 2.0
    assert decide(1, response=status(409, **{"Retry-After": "60"})) == 60.0
    assert decide(1, response=status(409, **{"Retry-After": "60.5"})) is None
    assert decide(1, response=status(409)) is None
    assert decide(1, error=httpx.ReadError("reset")) == 1.0
    assert decide(1, error=ValueError("not a transport error")) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("5", 5.0),
        (" 12 ", 12.0),
        ("1.5", 1.5),
        ("0", 0.0),
        ("-1", None),
        ("soon", None),
        ("", None),
        ("Sun, 06 Nov 1994 08:49:37 GMT", 10.0),
        ("Sunday, 06-Nov-94 08:49:37 GMT", 10.0),
        ("Sun Nov  6 08:49:37 1994", 10.0),
        ("Sun, 06 Nov 1994 08:49:17 GMT", 0.0),
    ],
)
def test_parse_retry_after(value: str, expected: float | None) -> None:
    now = email.utils.mktime_tz((1994, 11, 6, 8, 49, 27, 0, 1, -1, 0))
    assert parse_retry_after(value, now=now) == expected
