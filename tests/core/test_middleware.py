"""The middleware's contract, line by line, against FastAPI and plain Starlette apps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from starlette_idempotency import (
    IdempotencyMiddleware,
    MemoryStore,
    idempotent,
    mark_retryable,
)
from starlette_idempotency.stores import RecordStatus
from tests.support.asgi import payments_scope
from tests.support.guarded import GuardedApp, make_client, make_guarded_app

PAYMENT = {"amount": "10.00", "currency": "EUR"}


def key_headers(key: str = "key-1", **extra: str) -> dict[str, str]:
    return {"Idempotency-Key": key, **extra}


async def wait_for(event: asyncio.Event) -> None:
    async with asyncio.timeout(5):
        await event.wait()


async def held_in_handler(
    harness: GuardedApp, path: str, body: Any, *, gate: str
) -> asyncio.Task[httpx.Response]:
    """A request with the key ``key-1``, once it is in the handler, which it leaves when the
    ledger's ``gate`` is set."""
    request = harness.client.post(path, json=body, headers=key_headers(**{"x-gate": gate}))
    task = asyncio.create_task(request)
    await wait_for(harness.ledger.entered_event(gate))
    return task


async def test_first_request_runs_and_retry_replays(harness: GuardedApp) -> None:
    first = await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    assert first.status_code == 201
    assert "x-idempotent-replay" not in first.headers
    replay = await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    assert replay.status_code == 201
    assert replay.content == first.content
    assert replay.headers["x-idempotent-replay"] == "true"
    assert replay.headers["location"] == first.headers["location"]
    assert replay.headers["content-type"] == first.headers["content-type"]
    assert "set-cookie" in first.headers
    assert "set-cookie" not in replay.headers
    assert harness.ledger.executions["payments"] == 1


async def test_equivalent_json_is_the_same_request(harness: GuardedApp) -> None:
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    spaced = b'{ "currency" : "EUR",\n "amount": "10.00" }'
    replay = await harness.client.post(
        "/payments",
        content=spaced,
        headers=key_headers(**{"content-type": "application/json"}),
    )
    assert replay.headers["x-idempotent-replay"] == "true"
    assert harness.ledger.executions["payments"] == 1


@pytest.mark.parametrize("kind", ["fastapi", "starlette"])
async def test_repeated_query_values_and_chosen_headers_in_another_order_are_422(
    kind: str,
) -> None:
    # The app reads query_params.get() (the last value) and headers.get() (the first): the
    # same values in another order are another request.
    harness = await make_guarded_app(kind, fingerprint_headers=["X-Api-Version"])

    def post(query: str, versions: list[str], **extra: str) -> Any:
        headers = [("Idempotency-Key", "key-1"), *extra.items()]
        headers += [("X-Api-Version", version) for version in versions]
        return harness.client.post(f"/payments{query}", json=PAYMENT, headers=headers)

    assert (await post("?id=1&id=2&x=0", ["1", "2"])).status_code == 201
    replay = await post("?x=0&id=1&id=2", ["1", "2"], **{"X-Other": "ignored"})
    assert replay.headers["x-idempotent-replay"] == "true"
    assert (await post("?id=2&id=1&x=0", ["1", "2"])).status_code == 422
    assert (await post("?id=1&id=2&x=0", ["2", "1"])).status_code == 422
    assert harness.ledger.executions["payments"] == 1


async def test_missing_key_is_400(harness: GuardedApp) -> None:
    response = await harness.client.post("/payments", json=PAYMENT)
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {
        "error": "Idempotency-Key header is required",
        "code": "idempotency_key_missing",
    }
    assert harness.ledger.executions["payments"] == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("k" * 256, "Idempotency-Key must not exceed 255 characters"),
        ("", "Idempotency-Key must not be empty"),
        ('""', "Idempotency-Key must not be empty"),
        ("has space", None),
        ("ctl\x7f", None),
        ('"open', None),
    ],
)
async def test_invalid_keys_are_400(harness: GuardedApp, raw: str, message: str | None) -> None:
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers={"Idempotency-Key": raw}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error.startswith("Idempotency-Key")
    if message:
        assert error == message
    assert harness.ledger.executions["payments"] == 0
    assert len(harness.store) == 0


async def test_repeated_header_is_400(harness: GuardedApp) -> None:
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers=[("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    )
    assert response.status_code == 400
    assert "only once" in response.json()["error"]


async def test_two_keys_joined_by_a_proxy_are_400(harness: GuardedApp) -> None:
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers={"Idempotency-Key": "key-a,key-b"}
    )
    assert response.status_code == 400
    assert "only once" in response.json()["error"]
    assert harness.ledger.executions["payments"] == 0


async def test_quoted_key_means_the_unquoted_key(harness: GuardedApp) -> None:
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers("abc"))
    replay = await harness.client.post("/payments", json=PAYMENT, headers=key_headers('"abc"'))
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_255_character_quoted_key_is_accepted(harness: GuardedApp) -> None:
    response = await harness.client.post(
        "/payments", json=PAYMENT, headers=key_headers('"' + "k" * 255 + '"')
    )
    assert response.status_code == 201


async def test_mismatch_is_422(harness: GuardedApp) -> None:
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    other = await harness.client.post(
        "/payments", json={**PAYMENT, "amount": "99.00"}, headers=key_headers()
    )
    assert other.status_code == 422
    assert other.json() == {
        "error": "Idempotency key has already been used with a different request payload.",
        "code": "idempotency_key_reused",
        "first_request": {"status": 201, "location": "/payments/p_1"},
    }
    assert harness.ledger.executions["payments"] == 1


async def test_in_progress_is_409_and_mismatch_wins_over_it(harness: GuardedApp) -> None:
    client, ledger = harness.client, harness.ledger
    first = await held_in_handler(harness, "/payments", PAYMENT, gate="g")
    duplicate = await client.post("/payments", json=PAYMENT, headers=key_headers())
    assert duplicate.status_code == 409
    assert duplicate.json()["error"] == (
        "A request with this idempotency key is already being processed. "
        "Retry after the original request completes."
    )
    # A quarter of the time the first request has run, at least 1 s, at most the lock's rest.
    assert duplicate.headers["retry-after"] == "1"
    harness.clock.advance(12)
    assert (await client.post("/payments", json=PAYMENT, headers=key_headers())).headers[
        "retry-after"
    ] == "3"
    harness.clock.advance(17.2)
    later = await client.post("/payments", json=PAYMENT, headers=key_headers())
    assert later.headers["retry-after"] == "1"
    mismatch = await client.post("/payments", json={"amount": "1.00"}, headers=key_headers())
    assert mismatch.status_code == 422
    ledger.gate("g").set()
    assert (await first).status_code == 201
    assert ledger.executions["payments"] == 1


async def test_different_routes_are_different_operations(harness: GuardedApp) -> None:
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    refund = await harness.client.post("/refunds", json=PAYMENT, headers=key_headers())
    assert refund.status_code == 201
    assert "x-idempotent-replay" not in refund.headers
    assert harness.ledger.executions["payments"] == 2


@pytest.mark.parametrize("code", [400, 404, 409])
async def test_handler_4xx_is_stored_as_failed_and_replayed(harness: GuardedApp, code: int) -> None:
    first = await harness.client.post(f"/status/{code}", headers=key_headers())
    assert first.status_code == code
    replay = await harness.client.post(f"/status/{code}", headers=key_headers())
    assert replay.status_code == code
    assert replay.headers["x-idempotent-replay"] == "true"
    assert harness.ledger.executions[f"status-{code}"] == 1
    assert len(harness.store) == 1


@pytest.mark.parametrize("code", [200, 201, 204, 302])
async def test_2xx_and_3xx_are_completed(harness: GuardedApp, code: int) -> None:
    await harness.client.post(f"/status/{code}", headers=key_headers())
    replay = await harness.client.post(f"/status/{code}", headers=key_headers())
    assert replay.status_code == code
    assert harness.ledger.executions[f"status-{code}"] == 1


@pytest.mark.parametrize("code", [500, 502, 503, 408, 429])
async def test_transient_statuses_release_the_key(harness: GuardedApp, code: int) -> None:
    first = await harness.client.post(f"/status/{code}", headers=key_headers())
    assert first.status_code == code
    again = await harness.client.post(f"/status/{code}", headers=key_headers())
    assert again.status_code == code
    assert "x-idempotent-replay" not in again.headers
    assert harness.ledger.executions[f"status-{code}"] == 2
    assert len(harness.store) == 0


async def test_unhandled_exception_releases_the_key_and_propagates(harness: GuardedApp) -> None:
    with pytest.raises(RuntimeError, match="handler crashed"):
        await harness.client.post("/crash", headers=key_headers())
    assert len(harness.store) == 0
    with pytest.raises(RuntimeError, match="handler crashed"):
        await harness.client.post("/crash", headers=key_headers())
    assert harness.ledger.executions["crash"] == 2
    server = make_client(harness.app, raise_app_exceptions=False)  # as a server answers it
    assert (await server.post("/crash", headers=key_headers())).status_code == 500


async def test_exception_reaches_the_app_error_handling(harness: GuardedApp) -> None:
    transport = httpx.ASGITransport(app=harness.app)  # raise_app_exceptions=True
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with pytest.raises(RuntimeError, match="handler crashed"):
            await client.post("/crash", headers=key_headers())


async def test_mark_retryable_releases_the_key(harness: GuardedApp) -> None:
    for _ in range(2):
        response = await harness.client.post("/retryable", headers=key_headers())
        assert response.status_code == 400
        assert "x-idempotent-replay" not in response.headers
    assert harness.ledger.executions["retryable"] == 2


async def test_error_after_the_response_keeps_the_record(harness: GuardedApp) -> None:
    client = make_client(harness.app, raise_app_exceptions=False)  # the task fails after it
    first = await client.post("/background", headers=key_headers())
    assert first.status_code == 200
    replay = await client.post("/background", headers=key_headers())
    assert replay.headers["x-idempotent-replay"] == "true"
    assert harness.ledger.executions["background"] == 1


async def test_binary_and_streamed_bodies_replay_byte_for_byte(harness: GuardedApp) -> None:
    for path in ("/binary", "/stream"):
        first = await harness.client.post(path, headers=key_headers(path))
        replay = await harness.client.post(path, headers=key_headers(path))
        assert replay.content == first.content
        assert replay.headers["x-idempotent-replay"] == "true"
    assert harness.ledger.executions["binary"] == harness.ledger.executions["stream"] == 1


async def test_optional_key_route_runs_unprotected_without_a_key(harness: GuardedApp) -> None:
    assert (await harness.client.patch("/optional")).json() == {"n": 1}
    assert (await harness.client.patch("/optional")).json() == {"n": 2}
    keyed = await harness.client.patch("/optional", headers=key_headers())
    replay = await harness.client.patch("/optional", headers=key_headers())
    assert replay.json() == keyed.json() == {"n": 3}
    assert replay.headers["x-idempotent-replay"] == "true"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "HEAD"])
async def test_other_methods_pass_through(harness: GuardedApp, method: str) -> None:
    for _ in range(2):
        response = await harness.client.request(
            method, "/payments", json=PAYMENT, headers=key_headers()
        )
        assert "x-idempotent-replay" not in response.headers
        assert response.status_code != 400
    assert len(harness.store) == 0


async def test_undecorated_and_unknown_routes_pass_through(harness: GuardedApp) -> None:
    for _ in range(2):
        await harness.client.post("/unguarded", headers=key_headers())
    assert harness.ledger.executions["unguarded"] == 2
    assert (await harness.client.post("/nowhere", headers=key_headers())).status_code == 404
    assert len(harness.store) == 0


async def test_app_sees_every_byte_of_the_body(harness: GuardedApp) -> None:
    body = b'{"a": 1,  "b": [1, 2, 3]}'
    response = await harness.client.post(
        "/echo", content=body, headers=key_headers(**{"content-type": "application/json"})
    )
    assert response.content == body


async def test_invalid_json_is_fingerprinted_as_bytes(harness: GuardedApp) -> None:
    headers = key_headers(**{"content-type": "application/json"})
    first = await harness.client.post("/echo", content=b"{oops", headers=headers)
    assert first.content == b"{oops"
    replay = await harness.client.post("/echo", content=b"{oops", headers=headers)
    assert replay.headers["x-idempotent-replay"] == "true"
    other = await harness.client.post("/echo", content=b"{oops!", headers=headers)
    assert other.status_code == 422


async def test_body_larger_than_the_limit_is_413_before_the_store(kind: str) -> None:
    harness = await make_guarded_app(kind, max_body_bytes=100)
    response = await harness.client.post("/echo", content=b"x" * 101, headers=key_headers())
    assert response.status_code == 413
    assert "100-byte limit" in response.json()["error"]

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b"x" * 30

    streamed = await harness.client.post("/echo", content=chunks(), headers=key_headers())
    assert streamed.status_code == 413
    assert len(harness.store) == 0
    assert harness.ledger.executions["echo"] == 0


async def test_problem_details_format(kind: str) -> None:
    harness = await make_guarded_app(kind, error_format="problem", problem_type="https://e.x/idem")
    missing = await harness.client.post("/payments", json=PAYMENT)
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json() == {
        "type": "https://e.x/idem/key-missing",
        "title": "Idempotency-Key is missing",
        "status": 400,
        "detail": "Idempotency-Key header is required",
        "code": "idempotency_key_missing",
    }
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    mismatch = await harness.client.post("/payments", json={"amount": "1"}, headers=key_headers())
    assert mismatch.json()["title"] == "Idempotency-Key is already used"
    assert mismatch.json()["status"] == 422


async def test_problem_title_for_in_progress(kind: str) -> None:
    harness = await make_guarded_app(kind, error_format="problem")
    first = await held_in_handler(harness, "/payments", PAYMENT, gate="g")
    busy = await harness.client.post("/payments", json=PAYMENT, headers=key_headers())
    assert busy.json()["title"] == "A request is outstanding for this Idempotency-Key"
    harness.ledger.gate("g").set()
    await first


async def test_custom_header_name_is_used_everywhere(kind: str) -> None:
    harness = await make_guarded_app(kind, header_name="X-Request-Key")
    missing = await harness.client.post("/payments", json=PAYMENT)
    assert missing.json() == {
        "error": "X-Request-Key header is required",
        "code": "idempotency_key_missing",
    }
    await harness.client.post("/payments", json=PAYMENT, headers={"X-Request-Key": "a"})
    replay = await harness.client.post("/payments", json=PAYMENT, headers={"X-Request-Key": "a"})
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_expired_lock_lets_a_retry_run_again(harness: GuardedApp) -> None:
    """Seed scenario: the pod holding the lock dies; after the lock TTL a retry runs."""
    client = harness.client
    crashed = await held_in_handler(harness, "/short-lock", {}, gate="dead")
    assert (await client.post("/short-lock", json={}, headers=key_headers())).status_code == 409
    harness.clock.advance(5.1)
    retry = await client.post("/short-lock", json={}, headers=key_headers())
    assert retry.status_code == 200
    assert retry.json() == {"n": 2}
    crashed.cancel()


async def test_taken_over_request_answers_its_client_but_does_not_overwrite(
    harness: GuardedApp,
) -> None:
    client, ledger = harness.client, harness.ledger
    first = await held_in_handler(harness, "/short-lock", {}, gate="a")
    harness.clock.advance(5.1)
    second = await held_in_handler(harness, "/short-lock", {}, gate="b")
    ledger.gate("a").set()
    assert (await first).json() == {"n": 1}
    ledger.gate("b").set()
    assert (await second).json() == {"n": 2}
    replay = await client.post("/short-lock", json={}, headers=key_headers())
    assert replay.json() == {"n": 2}
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_lapsed_lock_with_no_successor_still_stores(harness: GuardedApp) -> None:
    client, ledger = harness.client, harness.ledger
    first = await held_in_handler(harness, "/short-lock", {}, gate="a")
    harness.clock.advance(5.1)
    ledger.gate("a").set()
    assert (await first).status_code == 200
    replay = await client.post("/short-lock", json={}, headers=key_headers())
    assert replay.headers["x-idempotent-replay"] == "true"
    assert ledger.executions["short-lock"] == 1


async def test_record_wire_fields(harness: GuardedApp) -> None:
    await harness.client.post("/payments", json=PAYMENT, headers=key_headers("wire"))
    (entry,) = harness.store.records().values()
    assert entry.key == "wire"
    assert entry.status is RecordStatus.COMPLETED
    assert entry.request_fingerprint.startswith("sha256:")
    assert entry.response is not None
    assert entry.response.status_code == 201
    assert entry.expires_at == pytest.approx(harness.clock.now + 24 * 3600)
    names = {name for name, _ in entry.response.headers}
    assert {"location", "content-type"} <= names
    assert "set-cookie" not in names


async def test_fifty_concurrent_requests_run_the_handler_once(harness: GuardedApp) -> None:
    client, ledger = harness.client, harness.ledger
    for round_number in range(5):
        gate = f"g{round_number}"
        headers = key_headers(f"race-{round_number}", **{"x-gate": gate})
        tasks = [
            asyncio.create_task(client.post("/payments", json=PAYMENT, headers=headers))
            for _ in range(50)
        ]
        await wait_for(ledger.entered_event(gate))
        # every duplicate is answered while the first is still held at its gate
        while sum(task.done() for task in tasks) < 49:
            done, _ = await asyncio.wait(
                [task for task in tasks if not task.done()],
                timeout=5,
                return_when=asyncio.FIRST_COMPLETED,
            )
            assert done, "duplicates did not answer while the first was running"
        ledger.gate(gate).set()
        statuses = sorted(response.status_code for response in await asyncio.gather(*tasks))
        assert statuses == [201] + [409] * 49
        assert ledger.executions["payments"] == round_number + 1


async def test_lifespan_and_websocket_scopes_pass_through() -> None:
    from starlette_idempotency import IdempotencyMiddleware, MemoryStore

    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(str(scope["type"]))

    middleware = IdempotencyMiddleware(app, store=MemoryStore())
    for scope_type in ("lifespan", "websocket"):
        await middleware({"type": scope_type}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan", "websocket"]


async def test_record_is_stored_before_the_last_chunk_reaches_the_client(kind: str) -> None:
    harness = await make_guarded_app(kind)
    seen_on_last_chunk: list[object] = []
    inner_send_messages: list[Message] = []

    body = b'{"amount": "1.00"}'
    scope = payments_scope((b"idempotency-key", b"order"))
    chunks = [body[:5], body[5:]]

    async def receive() -> Message:
        if chunks:
            part = chunks.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(chunks)}
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: Message) -> None:
        inner_send_messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            records = list(harness.store.records().values())
            seen_on_last_chunk.append(records[0].status if records else None)

    await harness.app(scope, receive, send)
    assert seen_on_last_chunk == [RecordStatus.COMPLETED]
    # multi-chunk request bodies reach the app whole
    assert b'"amount":"1.00"' in b"".join(m.get("body", b"") for m in inner_send_messages)


async def test_anonymous_warning_is_logged_once(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    harness = await make_guarded_app(kind)
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        await harness.client.post("/payments", json=PAYMENT, headers=key_headers("a"))
        await harness.client.post("/payments", json=PAYMENT, headers=key_headers("b"))
    warnings = [r for r in caplog.records if "not scoped to a user" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("lengths", [[b"abc"], [b"-1"], [b"1e3"], [b"13", b"14"]])
async def test_a_content_length_that_is_not_one_number_is_400(
    kind: str, lengths: list[bytes]
) -> None:
    harness = await make_guarded_app(kind)
    body = orjson.dumps(PAYMENT)
    scope = payments_scope(
        (b"idempotency-key", b"k"), *((b"content-length", length) for length in lengths)
    )
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await harness.app(scope, receive, send)
    assert sent[0]["status"] == 400
    assert b"Content-Length" in sent[1]["body"]
    assert harness.ledger.executions["payments"] == 0


@pytest.mark.parametrize("turns_first", [0, 1, 2])
async def test_mark_retryable_after_the_response_ended_changes_nothing(
    turns_first: int, caplog: pytest.LogCaptureFixture
) -> None:
    """From a background task, after the client got its 201: honoured, it freed the key (so a
    retry ran the handler again) or was ignored, as a turn of the loop fell."""
    runs: list[int] = []

    async def pay(request: Request) -> Response:
        runs.append(1)

        async def later() -> None:
            for _ in range(turns_first):
                await asyncio.sleep(0)
            mark_retryable(request)

        return JSONResponse({"ok": 1}, status_code=201, background=BackgroundTask(later))

    app = Starlette(routes=[Route("/pay", idempotent()(pay), methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: ""))
    headers = {"Idempotency-Key": "k"}
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        assert (await client.post("/pay", json={}, headers=headers)).status_code == 201
    retry = await client.post("/pay", json={}, headers=headers)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert runs == [1]
    assert "mark_retryable() came after the response to this request started" in caplog.text


async def test_mark_retryable_from_a_streamed_body_changes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Between two chunks of a 200 the client is already getting: honoured, it freed the key,
    and the retry of a response the client got whole ran the handler again."""
    runs: list[int] = []

    async def export(request: Request) -> Response:
        runs.append(1)

        async def body() -> AsyncIterator[bytes]:
            yield b"part one\n"
            mark_retryable(request)
            yield b"part two\n"

        return StreamingResponse(body(), media_type="text/plain")

    app = Starlette(routes=[Route("/export", idempotent()(export), methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore(), key_scope=lambda r: ""))
    headers = {"Idempotency-Key": "k"}
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        first = await client.post("/export", json={}, headers=headers)
    retry = await client.post("/export", json={}, headers=headers)
    assert first.text == retry.text == "part one\npart two\n"
    assert retry.headers["x-idempotent-replay"] == "true"
    assert runs == [1]
    assert "mark_retryable() came after the response to this request started" in caplog.text


async def test_mark_retryable_in_the_apps_500_handler_is_quietly_redundant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starlette runs the handler of an unhandled exception outside the middleware, once the
    key was freed: the handler's own answer goes out, and nothing warns."""

    async def pay(request: Request) -> Response:
        raise RuntimeError("boom")

    async def on_error(request: Request, exc: Exception) -> Response:
        mark_retryable(request)  # "any unexpected failure may be retried"
        return JSONResponse({"error": "internal"}, status_code=500)

    app = Starlette(
        routes=[Route("/pay", idempotent()(pay), methods=["POST"])],
        exception_handlers={Exception: on_error},
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "")
    client = make_client(app, raise_app_exceptions=False)
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        answer = await client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
    assert answer.status_code == 500
    assert answer.json() == {"error": "internal"}
    assert "mark_retryable" not in caplog.text
