"""What is stored of a response: headers never stored, a route's header lists, the redactor
(fail closed), and encryption at rest (replays byte-identical, keys rotated, an unknown key id
answered 503 without running the handler again)."""

from __future__ import annotations

import base64
import dataclasses
import re
import sys
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyEvent,
    IdempotencyMiddleware,
    MemoryStore,
    ResponseEncryption,
    StoredResponse,
    idempotent,
)
from starlette_idempotency._kept_response import SEALED_HEADER, never_stored
from tests.support.guarded import make_client

KEY = {"Idempotency-Key": "k"}
CARD = "4242424242424242"
# What the app answers beside its body: credentials a replay must never hand out, and ordinary
# headers it must keep.
SECRET_HEADERS = {
    "Authorization": "Bearer live-token",
    "Set-Cookie": "session=abc",
    "X-Api-Key": "sk_live_1",
    "X-Auth-Token": "t1",
    "X-Session-Id": "s1",
    "X-Refresh-Token": "r1",
    "X-Client-Secret": "c1",
}
ORDINARY_HEADERS = {"Location": "/payments/1", "X-Request-Id": "req-1", "ETag": '"v1"'}


def mask_cards(response: StoredResponse) -> StoredResponse:
    """The documented redactor: card numbers keep their last four digits."""
    masked = re.sub(rb"\b\d{12}(\d{4})\b", rb"************\1", response.body)
    return dataclasses.replace(response, body=masked)


class Payments:
    """``POST /pay`` answering a card number and headers of both kinds, behind the middleware."""

    def __init__(self, store: Any = None, route: dict[str, Any] | None = None, **options: Any):
        self.runs: Counter[str] = Counter()
        self.events: list[IdempotencyEvent] = []
        self.store = MemoryStore() if store is None else store

        @idempotent(**(route or {}))
        async def pay(request: Request) -> Response:
            self.runs["pay"] += 1
            body = {"card": CARD, "amount": 10, "run": self.runs["pay"]}
            headers = {**SECRET_HEADERS, **ORDINARY_HEADERS}
            return JSONResponse(body, status_code=201, headers=headers)

        app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
        self.middleware = IdempotencyMiddleware(
            app, store=self.store, on_event=self.events.append, **options
        )
        self.client = make_client(self.middleware)

    async def post(self, key: str = "k") -> httpx.Response:
        return await self.client.post("/pay", json={"amount": 10}, headers={"Idempotency-Key": key})

    def stored(self) -> StoredResponse:
        (record,) = self.store.records().values()
        assert record.response is not None
        return record.response


def lower(headers: dict[str, str]) -> set[str]:
    return {name.lower() for name in headers}


# --- headers ----------------------------------------------------------------------------------


async def test_credentials_and_hop_by_hop_headers_are_never_stored() -> None:
    app = Payments()
    first = await app.post()
    assert lower(SECRET_HEADERS) <= set(first.headers)  # the first client gets them all
    stored = {name for name, _ in app.stored().headers}
    assert not stored & lower(SECRET_HEADERS)
    assert lower(ORDINARY_HEADERS) <= stored
    replay = await app.post()
    assert not set(replay.headers) & lower(SECRET_HEADERS)
    assert replay.headers["location"] == "/payments/1"
    assert (replay.status_code, replay.content) == (first.status_code, first.content)


@pytest.mark.parametrize(
    "name",
    ["authorization", "www-authenticate", "cookie", "x-csrf-token", "x-amz-security-token",
     "x-user-password", "x-session", "x-goog-api-key", "x-apikey", "proxy-authorization",
     "connection", "transfer-encoding", "date", "server", ":status"],
)  # fmt: skip
def test_never_stored_names(name: str) -> None:
    assert never_stored(name)


@pytest.mark.parametrize(
    "name",
    ["location", "etag", "x-request-id", "content-type", "cache-control", "link",
     "access-control-allow-credentials", "access-control-allow-origin"],
)  # fmt: skip
def test_ordinary_names_are_stored(name: str) -> None:
    assert not never_stored(name)


async def test_stored_headers_is_an_allow_list_beside_the_bodys_own_headers() -> None:
    app = Payments(stored_headers=["Location"])
    first = await app.post()
    stored = dict(app.stored().headers)
    assert set(stored) == {"location", "content-length", "content-type"}
    replay = await app.post()
    assert replay.content == first.content
    assert "etag" not in replay.headers


async def test_a_route_refuses_more_headers_than_the_middleware() -> None:
    app = Payments(route={"never_stored_headers": ["ETag", "x-request-id"]})
    await app.post()
    stored = {name for name, _ in app.stored().headers}
    assert "etag" not in stored
    assert "x-request-id" not in stored
    assert "location" in stored


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stored_headers": ["Location", "Set-Cookie"]}, "stored_headers must not name set-cookie"),
        ({"stored_headers": ["X-Api-Key"]}, "must not name x-api-key"),
        ({"stored_headers": "Location"}, "stored_headers must be a sequence of header names"),
        ({"never_stored_headers": "ETag"}, "never_stored_headers must be a sequence of header"),
        ({"never_stored_headers": ["ETag", 3]}, "never_stored_headers must hold header names"),
        ({"redact_response": "mask"}, "redact_response must be a callable"),
    ],
)
def test_wrong_protection_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        idempotent(**options)
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)


# --- the redactor -----------------------------------------------------------------------------


async def test_the_redactor_masks_the_stored_copy_which_replays_return() -> None:
    app = Payments(redact_response=mask_cards)
    first = await app.post()
    assert first.json()["card"] == CARD  # the client that paid sees its own answer
    assert CARD.encode() not in app.stored().body
    replay = await app.post()
    assert replay.json()["card"] == "************4242"
    assert replay.headers["content-length"] == str(len(replay.content))
    assert app.runs["pay"] == 1


def _raises(response: StoredResponse) -> StoredResponse:
    raise RuntimeError("the masking service is down")


def _not_a_response(response: StoredResponse) -> Any:
    return {"body": b"masked"}


def _bytes_headers(response: StoredResponse) -> StoredResponse:
    return dataclasses.replace(response, headers=((b"x-masked", b"yes"),))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "redactor",
    [_raises, _not_a_response, _bytes_headers],
    ids=["raises", "wrong-type", "wrong-headers"],
)
async def test_a_failing_redactor_stores_the_status_only_and_keeps_the_key(
    redactor: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = Payments(route={"redact_response": redactor})
    first = await app.post()
    assert first.status_code == 201
    assert first.json()["card"] == CARD
    assert app.stored() == StoredResponse(201, (("x-idempotent-body-omitted", "true"),), b"")
    assert "redact_response" in caplog.text
    assert app.events[-1].result == "COMPLETED"
    assert app.events[-1].note == "redaction_failed"
    replay = await app.post()  # fail closed: the handler never runs again for this key
    assert app.runs["pay"] == 1
    assert (replay.status_code, replay.content) == (201, b"")
    assert replay.headers["x-idempotent-body-omitted"] == "true"
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_a_redactor_cannot_store_what_is_never_stored() -> None:
    def add_cookie(response: StoredResponse) -> StoredResponse:
        headers = (*response.headers, ("set-cookie", "session=stolen"), ("x-masked", "yes"))
        return dataclasses.replace(response, headers=headers)

    app = Payments(redact_response=add_cookie)
    await app.post()
    stored = dict(app.stored().headers)
    assert "set-cookie" not in stored
    assert stored["x-masked"] == "yes"


# --- encryption -------------------------------------------------------------------------------

KEY_1 = ResponseEncryption.generate_key()
KEY_2 = ResponseEncryption.generate_key()


def without_replay_marker(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [pair for pair in response.headers.raw if pair[0].lower() != b"x-idempotent-replay"]


async def test_the_store_holds_ciphertext_and_replays_are_byte_identical() -> None:
    app = Payments(encryption=ResponseEncryption({"k1": KEY_1}))
    first = await app.post()
    stored = app.stored()
    assert stored.headers == ((SEALED_HEADER, "aes-gcm;key=k1"),)
    assert stored.status_code == 201
    assert stored.content_type is None
    assert CARD.encode() not in stored.body
    assert b"/payments/1" not in stored.body
    replay = await app.post()
    assert replay.status_code == first.status_code
    assert replay.content == first.content
    kept = [pair for pair in first.headers.raw if not never_stored(pair[0].decode().lower())]
    assert without_replay_marker(replay) == kept
    assert app.runs["pay"] == 1


async def test_redaction_and_encryption_together() -> None:
    app = Payments(encryption=ResponseEncryption({"k1": KEY_1}), redact_response=mask_cards)
    await app.post()
    assert b"4242" not in app.stored().body
    assert (await app.post()).json()["card"] == "************4242"


async def test_a_rotated_key_still_replays_the_records_it_sealed() -> None:
    store = MemoryStore()
    before = Payments(store, encryption=ResponseEncryption({"k1": KEY_1}))
    first = await before.post("old")
    rotated = ResponseEncryption({"k2": KEY_2, "k1": KEY_1}, current="k2")
    after = Payments(store, encryption=rotated)
    replay = await after.post("old")
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert after.runs["pay"] == 0
    await after.post("new")
    sealed_with = {
        record.key: record.response.headers[0][1]
        for record in store.records().values()
        if record.response is not None
    }
    assert sealed_with == {"old": "aes-gcm;key=k1", "new": "aes-gcm;key=k2"}


@pytest.mark.parametrize(
    "reader_options",
    [{"encryption": ResponseEncryption({"k2": KEY_2})}, {}],
    ids=["key-id-retired", "encryption-turned-off"],
)
async def test_a_record_no_key_opens_is_a_503_and_never_runs_the_handler_again(
    reader_options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStore()
    await Payments(store, encryption=ResponseEncryption({"k1": KEY_1})).post()
    reader = Payments(store, **reader_options)
    for _ in range(3):
        answer = await reader.post()
        assert answer.status_code == 503
        assert answer.json()["code"] == "idempotency_response_unreadable"
        assert CARD not in answer.text
        assert "retry-after" not in answer.headers
    assert reader.runs["pay"] == 0
    assert reader.events[-1].result == "STORE_ERROR"
    assert reader.events[-1].note == "response_unreadable"
    assert "cannot be decrypted" in caplog.text


async def test_a_sealed_copy_moved_to_another_key_or_altered_does_not_open() -> None:
    store = MemoryStore()
    encryption = ResponseEncryption({"k1": KEY_1})
    app = Payments(store, encryption=encryption)
    await app.post("a")
    await app.post("b")
    records = store.records()
    (a_key,) = [key for key, record in records.items() if record.key == "a"]
    (b_key,) = [key for key, record in records.items() if record.key == "b"]
    sealed_a = records[a_key].response
    assert sealed_a is not None
    # another record's copy, another status, one flipped byte: none opens
    assert encryption.decrypt(sealed_a, a_key) is not None
    assert encryption.decrypt(sealed_a, b_key) is None
    assert encryption.decrypt(dataclasses.replace(sealed_a, status_code=200), a_key) is None
    flipped = sealed_a.body[:-1] + bytes([sealed_a.body[-1] ^ 1])
    assert encryption.decrypt(dataclasses.replace(sealed_a, body=flipped), a_key) is None


async def test_records_stored_before_encryption_was_turned_on_still_replay() -> None:
    store = MemoryStore()
    first = await Payments(store).post()
    after = Payments(store, encryption=ResponseEncryption({"k1": KEY_1}))
    replay = await after.post()
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert after.runs["pay"] == 0


@given(
    status=st.integers(min_value=200, max_value=499),
    headers=st.lists(st.tuples(st.text(min_size=1), st.text()), max_size=5),
    body=st.binary(max_size=200),
    store_key=st.text(),
)
def test_sealing_round_trips_every_response(
    status: int, headers: list[tuple[str, str]], body: bytes, store_key: str
) -> None:
    encryption = ResponseEncryption({"k1": KEY_1})
    response = StoredResponse(status, tuple(headers), body, None)
    sealed = encryption.encrypt(response, store_key)
    opened = encryption.decrypt(sealed, store_key)
    assert opened is not None
    assert (opened.status_code, opened.headers, opened.body) == (status, tuple(headers), body)
    assert encryption.decrypt(sealed, store_key + "x") is None


@pytest.mark.parametrize(
    ("keys", "current", "message"),
    [
        ({}, None, "needs at least one key"),
        ({"k1": b"short"}, None, "key 'k1' must be 16, 24 or 32 bytes"),
        ({"k1": "not base64!"}, None, "key 'k1' must be 16, 24 or 32 bytes"),
        ({"k1": KEY_1, "k2": KEY_2}, None, "with several keys needs current=<key id>"),
        ({"k1": KEY_1}, "k2", "current key id 'k2' is not among its keys"),
        ({"bad id": KEY_1}, None, "key ids are 1 to 64 letters"),
    ],
)
def test_wrong_encryption_settings_are_refused(
    keys: dict[str, Any], current: str | None, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        ResponseEncryption(keys, current=current)


def test_keys_of_every_aes_size_as_bytes_or_base64() -> None:
    for size in (16, 24, 32):
        ResponseEncryption({"raw": b"k" * size})
    urlsafe = base64.urlsafe_b64encode(b"\xfb\xff" * 16).decode()
    assert "-" in urlsafe
    assert "_" in urlsafe
    unpadded = base64.b64encode(b"k" * 32).decode().rstrip("=")
    encryption = ResponseEncryption({"urlsafe": urlsafe, "unpadded": unpadded}, current="urlsafe")
    assert encryption.current_key_id == "urlsafe"


def test_encryption_must_be_a_response_encryption() -> None:
    with pytest.raises(ConfigurationError, match="encryption must be a ResponseEncryption"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), encryption={"k1": KEY_1})  # type: ignore[arg-type]


def test_keys_never_appear_in_a_repr() -> None:
    encryption = ResponseEncryption({"k2": KEY_2, "k1": KEY_1}, current="k2")
    assert repr(encryption) == "ResponseEncryption(key_ids=['k2', 'k1'], current='k2')"
    from starlette.middleware import Middleware

    printed = repr(Middleware(IdempotencyMiddleware, store=MemoryStore(), encryption=encryption))
    assert KEY_1 not in printed
    assert KEY_2 not in printed


def test_without_the_extra_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers.aead", None)
    with pytest.raises(ImportError, match=re.escape("starlette-idempotency[encryption]")):
        ResponseEncryption({"k1": KEY_1})
