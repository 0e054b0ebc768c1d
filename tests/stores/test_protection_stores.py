"""Encryption at rest against real Redis and PostgreSQL: what the server holds is ciphertext,
a rotated key still replays the records it sealed, and a record no configured key opens is a
503 that never runs the handler again."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import orjson
import pytest
import redis.asyncio as aioredis

from starlette_idempotency import ResponseEncryption
from starlette_idempotency.stores.base import IdempotencyStore
from starlette_idempotency.stores.postgres import PostgresStore
from starlette_idempotency.stores.redis import RedisStore
from starlette_idempotency.testing._isolation import delete_prefixed, unique_prefix
from tests.core.test_protection import CARD, KEY_1, KEY_2, Payments

# What the server holds for each record: (headers, body, content type) as stored.
Raw = tuple[Any, bytes, Any]
Backend = tuple[IdempotencyStore, Callable[[], Awaitable[list[Raw]]]]


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("postgres", marks=pytest.mark.postgres)])  # fmt: skip
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A real store, and a reader of what its server holds, under the test's own prefix or
    table."""
    if request.param == "redis":
        raw = aioredis.from_url(request.getfixturevalue("redis_url"))
        prefix = unique_prefix()

        async def held_in_redis() -> list[Raw]:
            found = []
            async for key in raw.scan_iter(match=f"{prefix}*"):
                value = await raw.get(key)
                assert value is not None
                record = orjson.loads(value)
                if record.get("responseStatusCode") is not None:
                    assert record["responseBodyEncoding"] == "base64"
                    body = base64.b64decode(record["responseBody"])
                    found.append((record["responseHeaders"], body, record["responseContentType"]))
            return found

        store = RedisStore(raw, key_prefix=prefix)
        try:
            yield store, held_in_redis
        finally:
            await store.aclose()
            await delete_prefixed(raw, prefix)
            await raw.aclose()
        return
    dsn, table = request.getfixturevalue("postgres_dsn"), request.getfixturevalue("postgres_table")
    postgres = await PostgresStore.connect(dsn, table=table)
    sql = await asyncpg.connect(dsn)

    async def held_in_postgres() -> list[Raw]:
        rows = await sql.fetch(
            f'SELECT response_headers, response_body, response_content_type FROM "{table}" '
            "WHERE response_status_code IS NOT NULL"
        )
        return [(orjson.loads(row[0]), bytes(row[1]), row[2]) for row in rows]

    try:
        await postgres.create_schema()
        yield postgres, held_in_postgres
    finally:
        await postgres.aclose()
        await sql.close()


async def test_the_server_holds_ciphertext_and_replays_are_identical(backend: Backend) -> None:
    store, held = backend
    app = Payments(store, encryption=ResponseEncryption({"k1": KEY_1}))
    first = await app.post()
    ((headers, body, content_type),) = await held()
    assert headers == [[":sealed", "aes-gcm;key=k1"]]
    assert content_type is None
    for plain in (CARD.encode(), b"/payments/1", b"req-1", b"application/json"):
        assert plain not in body
    replay = await app.post()
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert replay.headers["location"] == "/payments/1"
    assert app.runs["pay"] == 1


async def test_a_rotation_replays_old_records_and_seals_new_ones_with_the_new_key(
    backend: Backend,
) -> None:
    store, held = backend
    first = await Payments(store, encryption=ResponseEncryption({"k1": KEY_1})).post("old")
    rotated = Payments(
        store, encryption=ResponseEncryption({"k2": KEY_2, "k1": KEY_1}, current="k2")
    )
    replay = await rotated.post("old")
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert rotated.runs["pay"] == 0
    await rotated.post("new")
    assert sorted(headers[0][1] for headers, _, _ in await held()) == [
        "aes-gcm;key=k1",
        "aes-gcm;key=k2",
    ]


async def test_a_record_of_a_retired_key_is_a_503_and_the_handler_never_runs_again(
    backend: Backend,
) -> None:
    store, _ = backend
    await Payments(store, encryption=ResponseEncryption({"k1": KEY_1})).post()
    retired = Payments(store, encryption=ResponseEncryption({"k2": KEY_2}))
    for _ in range(2):
        answer = await retired.post()
        assert answer.status_code == 503
        assert answer.json() == {
            "error": "The stored response for this idempotency key cannot be decrypted; the "
            "request is not run again. Retry later with the same key.",
            "code": "idempotency_response_unreadable",
        }
    assert retired.runs["pay"] == 0
