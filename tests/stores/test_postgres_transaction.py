"""``idempotency_transaction``: the payment row and the idempotency record commit together, on
the app's own connection (asyncpg, SQLAlchemy's AsyncConnection and AsyncSession), fenced by
the owner token, at every isolation level. In-process against the real PostgreSQL; the same
app runs as uvicorn pods in ``test_transaction_pods``."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    MemoryStore,
    PostgresStore,
    idempotency_context,
    idempotency_transaction,
    idempotent,
    mark_retryable,
)
from starlette_idempotency.stores import RecordStatus
from starlette_idempotency.stores.base import IdempotencyStore
from tests.stores.transaction_app import (
    ISOLATIONS,
    Database,
    build_app,
)
from tests.support.conditions import eventually
from tests.support.guarded import make_client

pytestmark = pytest.mark.postgres

DRIVERS = ("asyncpg", "sqlalchemy", "session")


@pytest.fixture(params=DRIVERS)
async def app(
    request: pytest.FixtureRequest, postgres_dsn: str, tables: str
) -> AsyncIterator[tuple[httpx.AsyncClient, Database]]:
    guarded, database, store = build_app(postgres_dsn, tables, request.param)
    async with make_client(guarded, raise_app_exceptions=False) as client:
        yield client, database
    await database.aclose()
    await store.aclose()


def guarded_by(store: IdempotencyStore, pay: object) -> Starlette:
    """``pay`` at ``POST /pay``, the middleware added as the docs say (inside the app's error
    middleware, which would otherwise answer an exception before the middleware saw it)."""
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])  # type: ignore[arg-type]
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


async def payments(sql: Any, table: str, key: str) -> list[str]:
    rows = await sql.fetch(f"SELECT amount FROM {table}_payments WHERE idempotency_key = $1", key)
    return [row["amount"] for row in rows]


async def record_of(sql: Any, table: str, key: str) -> Any:
    return await sql.fetchrow(
        f"SELECT status, owner_token, response_body, checkpoints::text AS checkpoints"
        f" FROM {table} WHERE idempotency_key = $1",
        key,
    )


@pytest.mark.parametrize("isolation", ISOLATIONS)
async def test_the_payment_and_its_record_commit_together(
    app: tuple[httpx.AsyncClient, Database], sql: Any, tables: str, isolation: str
) -> None:
    client, _ = app
    headers = {"Idempotency-Key": f"k-{isolation}", "X-Isolation": isolation}
    first = await client.post("/pay", json={"amount": "9.99"}, headers=headers)
    assert first.status_code == 201, first.text
    record = await record_of(sql, tables, f"k-{isolation}")
    assert record["status"] == "Completed"
    assert record["response_body"] == first.content
    assert "payment_written" in record["checkpoints"]

    retry = await client.post("/pay", json={"amount": "9.99"}, headers=headers)
    assert retry.headers["x-idempotent-replay"] == "true"
    assert retry.json() == first.json()
    assert await payments(sql, tables, f"k-{isolation}") == ["9.99"]


async def test_the_middleware_does_not_write_the_outcome_again(
    postgres_dsn: str, tables: str
) -> None:
    """One round trip fewer: the transaction wrote the outcome, so no ``finish`` follows."""
    calls: list[str] = []

    class Calls:
        def observe_event(self, event: object) -> None:
            pass

        def observe_store_call(self, store: str, operation: str, seconds: float, ok: bool) -> None:
            calls.append(operation)

        def observe_processing_timeout(self, endpoint: str, reason: str) -> None:
            pass

    counted, database, store = build_app(postgres_dsn, tables, "asyncpg", metrics=Calls())
    async with make_client(counted) as client:
        response = await client.post("/pay", json={"amount": "1"}, headers={"Idempotency-Key": "k"})
    await database.aclose()
    await store.aclose()
    assert response.status_code == 201
    assert calls == ["try_acquire"]


async def test_a_lease_taken_over_before_the_transaction_commits_nothing(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The first attempt waits (a frozen process) while its lease lapses and a retry takes the
    key over and completes; when it goes on, its transaction refuses (``LockLostError``): its
    payment row rolls back, and its client gets the retry's answer."""
    gate = asyncio.Event()
    entered = asyncio.Event()
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, "asyncpg")

    @idempotent(lock_ttl_seconds=30, renew_lock=False)
    async def pay(request: Request) -> Response:
        first = not entered.is_set()
        entered.set()
        if first:
            await gate.wait()

        async def work(connection: Any, fetchval: Any) -> Response:
            async with idempotency_transaction(request, connection) as tx:
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('k', '1', $1)",
                    "first" if first else "retry",
                )
                return await tx.respond(JSONResponse({"by": "first" if first else "retry"}, 201))

        response: Response = await database.in_transaction("read_committed", work)
        return response

    app = guarded_by(store, pay)
    async with make_client(app) as client:
        headers = {"Idempotency-Key": "k"}
        first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
        await asyncio.wait_for(entered.wait(), 5)
        # The lease lapses (on the database's clock) while the first attempt is frozen.
        await sql.execute(f"UPDATE {tables} SET expires_at = now() - interval '1 second'")
        retry = await client.post("/pay", json={}, headers=headers)
        assert retry.status_code == 201
        assert retry.json() == {"by": "retry"}
        gate.set()
        answered = await first
    await database.aclose()
    await store.aclose()
    assert answered.status_code == 201
    assert answered.json() == {"by": "retry"}
    assert answered.headers["x-idempotent-replay"] == "true"
    rows = await sql.fetch(f"SELECT pod FROM {tables}_payments")
    assert [row["pod"] for row in rows] == ["retry"]


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_retry_while_the_transaction_is_open_is_held_then_replayed(
    postgres_dsn: str, tables: str, sql: Any, isolation: str, driver: str
) -> None:
    """The lease has lapsed (on the database's clock) when the transaction begins, and nobody
    took the key yet: the transaction fences the row, a retry meanwhile is answered 409 at
    once (it waited for the row, and past the store's timeout got 503), and once the
    transaction has committed the retry is replayed, at every isolation level."""
    lapsed = asyncio.Event()
    in_transaction = asyncio.Event()
    go_on = asyncio.Event()
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, driver)
    runs: list[int] = []

    @idempotent(lock_ttl_seconds=30)
    async def pay(request: Request) -> Response:
        runs.append(1)
        await lapsed.wait()

        async def work(connection: Any, fetchval: Any) -> Response:
            async with idempotency_transaction(request, connection) as tx:
                await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ('k', '1', '')"
                )
                in_transaction.set()
                await go_on.wait()
                return await tx.respond(JSONResponse({"run": len(runs)}, 201))

        response: Response = await database.in_transaction(isolation, work)
        return response

    async with make_client(guarded_by(store, pay)) as client:
        headers = {"Idempotency-Key": "k"}
        first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
        try:
            await eventually(lambda: runs, message="the first attempt to run")
            await sql.execute(f"UPDATE {tables} SET expires_at = now() - interval '1 second'")
            lapsed.set()
            await asyncio.wait_for(in_transaction.wait(), 5)
            held = await client.post("/pay", json={}, headers=headers)
        finally:
            go_on.set()
        assert (await first).status_code == 201
        replayed = await client.post("/pay", json={}, headers=headers)
    await database.aclose()
    await store.aclose()
    assert held.status_code == 409, held.text
    assert replayed.status_code == 201, replayed.text
    assert replayed.headers["x-idempotent-replay"] == "true"
    assert runs == [1]
    assert await payments(sql, tables, "k") == ["1"]


async def refusal(store: IdempotencyStore, dsn: str) -> str:
    """What entering ``idempotency_transaction`` on a connection to ``dsn`` refuses, in a
    request guarded with ``store``."""
    seen: list[str] = []

    @idempotent()
    async def pay(request: Request) -> Response:
        connection = await asyncpg.connect(dsn)
        try:
            async with idempotency_transaction(request, connection):
                pass
        except ConfigurationError as exc:
            seen.append(str(exc))
        finally:
            await connection.close()
        return JSONResponse({})

    async with make_client(guarded_by(store, pay)) as client:
        await client.post("/pay", headers={"Idempotency-Key": "k"})
    [message] = seen
    return message


async def test_it_needs_postgres_store_on_the_apps_database(postgres_dsn: str) -> None:
    message = await refusal(MemoryStore(), postgres_dsn)
    assert "needs PostgresStore" in message
    assert "MemoryStore" in message


async def test_a_connection_to_another_database_is_refused(
    postgres_dsn: str, postgres_admin_dsn: str, tables: str
) -> None:
    """The record lives in the store's database: a connection elsewhere cannot fence it."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    other = postgres_admin_dsn.rsplit("/", 1)[0] + "/postgres"
    message = await refusal(store, other)
    await store.aclose()
    assert "not on the database of the store" in message


async def test_a_connection_of_another_kind_is_refused(postgres_dsn: str, tables: str) -> None:
    seen: list[str] = []
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)

    @idempotent()
    async def pay(request: Request) -> Response:
        with pytest.raises(ConfigurationError, match="asyncpg Connection") as refused:
            idempotency_transaction(request, object())
        seen.append(str(refused.value))
        return JSONResponse({})

    async with make_client(guarded_by(store, pay)) as client:
        assert (await client.post("/pay", headers={"Idempotency-Key": "k"})).status_code == 200
    await store.aclose()
    assert seen


async def test_a_record_no_longer_in_progress_is_not_fenced(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """The transaction's rows never commit once the record is another's or finished."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, "asyncpg")
    outcome: list[str] = []

    @idempotent()
    async def pay(request: Request) -> Response:
        # Another attempt owns the key now (its owner token replaced ours).
        await sql.execute(f"UPDATE {tables} SET owner_token = 'someone-else'")

        async def work(connection: Any, fetchval: Any) -> None:
            async with idempotency_transaction(request, connection):
                await fetchval(f"INSERT INTO {tables}_payments VALUES (DEFAULT, 'k', '1', '')")

        try:
            await database.in_transaction("read_committed", work)
        except Exception as exc:
            outcome.append(type(exc).__name__)
            raise
        return JSONResponse({})

    async with make_client(guarded_by(store, pay)) as client:
        response = await client.post("/pay", headers={"Idempotency-Key": "k"})
    await database.aclose()
    await store.aclose()
    assert outcome == ["LockLostError"]
    assert response.status_code == 409  # the other attempt is still running
    assert await payments(sql, tables, "k") == []
    record = await record_of(sql, tables, "k")
    assert record["owner_token"] == "someone-else"
    assert record["status"] == RecordStatus.IN_PROGRESS.value


async def test_a_rolled_back_recovery_point_is_never_written_later(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """A recovery point written in a transaction that rolls back is gone with it: the key is
    freed as for any failure, and the retry runs as a first attempt, not as a recovery."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, "asyncpg")
    recovered: list[str | None] = []

    @idempotent()
    async def pay(request: Request) -> Response:
        recovered.append(idempotency_context(request).recovered_from)

        async def work(connection: Any, fetchval: Any) -> Response:
            async with idempotency_transaction(request, connection) as tx:
                await fetchval(f"INSERT INTO {tables}_payments VALUES (DEFAULT, 'k', '1', '')")
                await tx.checkpoint("payment_written")
                if len(recovered) == 1:
                    raise RuntimeError("the first attempt fails after its checkpoint")
                return await tx.respond(JSONResponse({}, status_code=201))

        response: Response = await database.in_transaction("read_committed", work)
        return response

    async with make_client(guarded_by(store, pay), raise_app_exceptions=False) as client:
        failed = await client.post("/pay", headers={"Idempotency-Key": "k"})
        retried = await client.post("/pay", headers={"Idempotency-Key": "k"})
    await database.aclose()
    await store.aclose()
    assert failed.status_code == 500
    assert retried.status_code == 201
    assert recovered == [None, None]
    assert await payments(sql, tables, "k") == ["1"]
    record = await record_of(sql, tables, "k")
    assert "payment_written" in record["checkpoints"]  # the committed one, with the outcome


ROUNDS = 25


async def test_a_lapsed_lease_racing_its_takeover_commits_one_payment(
    postgres_dsn: str, tables: str, sql: Any
) -> None:
    """Over many rounds, a first attempt's lease lapses at a random moment (before, during or
    after its transaction) while a retry races it: one payment row per key, and the clients
    that got an answer got the same one."""
    rng = random.Random(29)
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, "asyncpg")
    pauses: dict[str, list[float]] = {}
    runs: list[int] = []  # how many attempts ran the handler, per round

    @idempotent(lock_ttl_seconds=30, renew_lock=False)
    async def pay(request: Request) -> Response:
        key = request.headers["idempotency-key"]
        before, inside = pauses[key].pop(0), pauses[key].pop(0)
        await asyncio.sleep(before)

        async def work(connection: Any, fetchval: Any) -> Response:
            async with idempotency_transaction(request, connection) as tx:
                payment = await fetchval(
                    f"INSERT INTO {tables}_payments (idempotency_key, amount, pod) "
                    "VALUES ($1, '1', '') RETURNING id",
                    key,
                )
                await asyncio.sleep(inside)
                return await tx.respond(JSONResponse({"payment": payment}, status_code=201))

        response: Response = await database.in_transaction("read_committed", work)
        return response

    async with make_client(guarded_by(store, pay)) as client:
        for round_ in range(ROUNDS):
            key = f"race-{round_}"
            pauses[key] = [rng.uniform(0, 0.02) for _ in range(4)]
            headers = {"Idempotency-Key": key}
            first = asyncio.create_task(client.post("/pay", json={}, headers=headers))
            await asyncio.sleep(rng.uniform(0, 0.03))
            # The lease lapses on the database's clock, unless the record is finished by now
            # (an UPDATE waits for the transaction's row lock, then sees the row it left).
            await sql.execute(
                f"UPDATE {tables} SET expires_at = now() - interval '1 second'"
                " WHERE idempotency_key = $1 AND status = 'InProgress'",
                key,
            )
            retry = await client.post("/pay", json={}, headers=headers)
            answers = [await first, retry]
            assert await payments(sql, tables, key) == ["1"], round_
            bodies = {a.content for a in answers if a.status_code == 201}
            assert len(bodies) == 1, (round_, [(a.status_code, a.text) for a in answers])
            assert {a.status_code for a in answers} <= {201, 409}, round_
            runs.append(2 - len(pauses[key]) // 2)
    await database.aclose()
    await store.aclose()
    # The race was run both ways: rounds where the retry took the key over and ran too.
    assert 1 in runs, runs
    assert 2 in runs, runs


async def test_mark_retryable_after_a_committed_outcome_warns(
    postgres_dsn: str, tables: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The transaction committed the outcome, then the handler raised: the ending's release
    leaves the committed outcome, so the key is not freed, and a mark from the app's handler of
    the exception (outside the middleware) changes nothing and says so."""
    store = PostgresStore.from_dsn(postgres_dsn, table=tables)
    database = Database(postgres_dsn, tables, "asyncpg")
    runs: list[int] = []

    @idempotent()
    async def pay(request: Request) -> Response:
        runs.append(1)

        async def work(connection: Any, fetchval: Any) -> None:
            async with idempotency_transaction(request, connection) as tx:
                await tx.respond(JSONResponse({"paid": 1}, status_code=201))

        await database.in_transaction("read_committed", work)
        raise RuntimeError("failed after the commit")

    async def on_error(request: Request, exc: Exception) -> Response:
        mark_retryable(request)
        return JSONResponse({"error": "retry"}, status_code=500)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])], exception_handlers={Exception: on_error}
    )
    app.add_middleware(IdempotencyMiddleware, store=store)
    headers = {"Idempotency-Key": "k"}
    async with make_client(app, raise_app_exceptions=False) as client:
        with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
            await client.post("/pay", json={}, headers=headers)
        retry = await client.post("/pay", json={}, headers=headers)
    await database.aclose()
    await store.aclose()
    assert retry.headers["x-idempotent-replay"] == "true"
    assert runs == [1]
    assert "mark_retryable() came after the response to this request started" in caplog.text
