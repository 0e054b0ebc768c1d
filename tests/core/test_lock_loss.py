"""A lock that vanishes while its handler runs (evicted, deleted, expired while frozen).

The request takes its key back with its own owner token as soon as it notices (at the next
renewal, or when it stores its response) and reports ``LOCK_LOST`` each time; a key that
another request holds by then is left alone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    IdempotencyEvent,
    IdempotencyMiddleware,
    MemoryStore,
    checkpoint,
    idempotent,
    storage_key,
)
from starlette_idempotency._lease import _going_on_from
from starlette_idempotency._record import Checkpoint
from starlette_idempotency._store_calls import BoundedStore
from starlette_idempotency.stores import (
    AcquireResult,
    FencedWrite,
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
)
from starlette_idempotency.stores.base import TAKING_BACK
from tests.support.conditions import eventually
from tests.support.guarded import make_client
from tests.support.records import pending

LOCK_TTL = 0.3
KEY = storage_key("t", "POST", "/slow", "k")
HEADERS = {"Idempotency-Key": "k"}


class TakingBack(MemoryStore):
    """Records the owner token each acquire is marked as taking back (``None``: none)."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[str | None] = []

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.marks.append(TAKING_BACK.get())
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)


class App:
    """A slow guarded handler that waits for ``release``, and the events it caused."""

    def __init__(self, *, renew: bool = True, recovery_point: bool = False) -> None:
        self.store = TakingBack()
        self.release = asyncio.Event()
        self.runs = 0
        self.events: list[IdempotencyEvent] = []

        @idempotent(lock_ttl_seconds=LOCK_TTL, renew_lock=renew)
        async def slow(request: Request) -> Response:
            self.runs += 1
            if recovery_point:
                await checkpoint(request, "charged")
            await self.release.wait()
            return JSONResponse({"run": self.runs})

        app = Starlette(routes=[Route("/slow", slow, methods=["POST"])])
        middleware = IdempotencyMiddleware(
            app, store=self.store, key_scope=lambda r: "t", on_event=self.events.append
        )
        self.client = make_client(middleware)

    def lock_lost_notes(self) -> list[str | None]:
        return [e.note for e in self.events if e.result == "LOCK_LOST"]

    async def taken_back_by(self, owner_token: str) -> None:
        """Wait until the key is held by ``owner_token`` again."""

        async def back() -> bool:
            record = await self.store.get(KEY)
            return record is not None and record.owner_token == owner_token

        await eventually(back, message="the lock taken back by its owner")

    async def delete_the_lock(self) -> IdempotencyRecord:
        """What an eviction or an operator's DEL does to the held key."""
        record = await self.store.get(KEY)
        assert record is not None
        assert await self.store.release(KEY, record.owner_token)
        return record


async def test_renewal_takes_a_vanished_lock_back_so_a_retry_cannot_run() -> None:
    app = App()
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))
    await eventually(lambda: app.runs == 1, message="the handler to start")
    held = await app.delete_the_lock()

    await app.taken_back_by(held.owner_token)
    # The acquire, then the take-back, marked so that no store undoes it.
    assert app.store.marks == [None, held.owner_token]
    retry = await app.client.post("/slow", headers=HEADERS)
    assert retry.status_code == 409
    assert app.lock_lost_notes() == ["reclaimed"]
    app.release.set()
    assert (await first).status_code == 200
    replay = await app.client.post("/slow", headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert app.runs == 1


async def taken_by_another(app: App) -> IdempotencyRecord:
    """The held key deleted and acquired by another request; the lock it took."""
    held = await app.delete_the_lock()
    now = time.time()
    other = IdempotencyRecord(
        key="k",
        status=RecordStatus.IN_PROGRESS,
        request_fingerprint=held.request_fingerprint,
        owner_token="another-request",
        created_at=now,
        expires_at=now + 30,
    )
    assert (await app.store.try_acquire(KEY, other, 30)).acquired
    await eventually(lambda: "taken_over" in app.lock_lost_notes(), message="LOCK_LOST")
    return held


async def test_renewal_leaves_a_key_another_request_took() -> None:
    app = App()
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))
    await eventually(lambda: app.runs == 1, message="the handler to start")
    await taken_by_another(app)
    app.release.set()
    assert (await first).status_code == 200
    current = await app.store.get(KEY)
    assert current is not None
    assert current.owner_token == "another-request"
    assert current.status is RecordStatus.IN_PROGRESS


async def test_renewal_takes_back_a_key_the_other_request_lets_go() -> None:
    """Another request's lock on the key goes while this handler still runs (an acquire whose
    request gave up, undone; a release): renewal goes on trying, takes the key back, and a
    retry gets 409 rather than running the handler a second time."""
    app = App()
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))
    await eventually(lambda: app.runs == 1, message="the handler to start")
    held = await taken_by_another(app)
    assert await app.store.release(KEY, "another-request")

    await app.taken_back_by(held.owner_token)
    retry = await app.client.post("/slow", headers=HEADERS)
    assert retry.status_code == 409
    assert app.lock_lost_notes() == ["taken_over", "reclaimed"]
    app.release.set()
    assert (await first).status_code == 200
    replay = await app.client.post("/slow", headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert app.runs == 1


async def test_renewal_takes_back_a_key_a_successor_kept_for_recovery() -> None:
    """A successor recovered the key (the first lease lapsed while its process was frozen),
    saved a recovery point of its own and failed: it ends its lease, keeping the points for a
    retry. The first handler still runs, so it takes the key back, with those points; a retry
    gets 409 rather than recovering and running beside it."""
    app = App(recovery_point=True)
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))

    async def charged() -> bool:
        record = await app.store.get(KEY)
        return record is not None and bool(record.checkpoints)

    await eventually(charged, message="the handler's recovery point")
    held = await app.delete_the_lock()
    now = time.time()
    successor = replace(
        held,
        owner_token="successor",
        checkpoints=(*held.checkpoints, Checkpoint("refunded", None, now)),
    )
    assert (await app.store.try_acquire(KEY, successor, 30)).acquired
    assert await app.store.save_progress(KEY, successor, 60, 0.0)

    await app.taken_back_by(held.owner_token)
    retry = await app.client.post("/slow", headers=HEADERS)
    assert retry.status_code == 409
    kept = await app.store.get(KEY)
    assert kept is not None
    assert [point.name for point in kept.checkpoints] == ["charged", "refunded"]
    app.release.set()
    assert (await first).status_code == 200
    replay = await app.client.post("/slow", headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert app.runs == 1


async def test_renewal_stops_once_the_other_request_stored_the_outcome() -> None:
    """Once the request that took the key stored its outcome, there is nothing to take
    back: renewal ends, and the outcome stays the other request's."""
    app = App()
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))
    await eventually(lambda: app.runs == 1, message="the handler to start")
    await taken_by_another(app)
    other = await app.store.get(KEY)
    assert other is not None
    done = other.finished(RecordStatus.COMPLETED, StoredResponse(201, (), b"{}"), time.time() + 60)
    assert await app.store.finish(KEY, done, 60)
    calls = len(app.store.marks)
    # The next renewal finds the outcome; in two intervals more, none tries again.
    await eventually(lambda: len(app.store.marks) > calls, message="a take-back tried")
    await asyncio.sleep(LOCK_TTL * 2 / 3)
    assert len(app.store.marks) == calls + 1
    app.release.set()
    assert (await first).status_code == 200
    current = await app.store.get(KEY)
    assert current is not None
    assert current.owner_token == "another-request"
    assert app.lock_lost_notes() == ["taken_over", "taken_over"]


async def test_complete_over_a_vanished_lock_stores_and_reports_it() -> None:
    app = App(renew=False)
    first = asyncio.create_task(app.client.post("/slow", headers=HEADERS))
    await eventually(lambda: app.runs == 1, message="the handler to start")
    await app.delete_the_lock()
    app.release.set()
    assert (await first).status_code == 200
    outcomes = [(e.result, e.note) for e in app.events if e.event == "idempotency_outcome"]
    assert outcomes == [("LOCK_LOST", "reclaimed"), ("COMPLETED", None)]
    replay = await app.client.post("/slow", headers=HEADERS)
    assert replay.headers["x-idempotent-replay"] == "true"
    assert app.runs == 1


class ProtocolOnly:
    """A store written to the protocol alone, without ``StoreBase``."""

    name = "protocol-only"
    supports_recovery = False

    def __init__(self) -> None:
        self.inner = MemoryStore()
        self.acquires: list[tuple[bool, str | None]] = []

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        self.acquires.append((recover, TAKING_BACK.get()))
        return await self.inner.try_acquire(key, pending, lock_ttl, recover=recover)

    async def finish(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        return await self.inner.finish(key, record, ttl)

    async def save_progress(
        self, key: str, record: IdempotencyRecord, ttl: float, lease: float
    ) -> bool:
        return await self.inner.save_progress(key, record, ttl, lease)

    async def release(self, key: str, owner_token: str) -> bool:
        return await self.inner.release(key, owner_token)

    async def renew(self, key: str, owner_token: str, lock_ttl: float) -> bool:
        return await self.inner.renew(key, owner_token, lock_ttl)

    async def get(self, key: str) -> IdempotencyRecord | None:
        return await self.inner.get(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_store_written_to_the_protocol_alone_takes_back_too() -> None:
    store = ProtocolOnly()
    bounded = BoundedStore(store, timeout=1.0, metrics=None, tracer=None)
    record = pending("k", "handler")
    assert (await bounded.take_back("k", record, 30)).acquired
    assert store.acquires == [(True, "handler")]
    assert TAKING_BACK.get() is None  # the mark lasts the call only
    held = await store.get("k")
    assert held is not None
    assert held.owner_token == "handler"


def test_a_successors_points_read_back_from_a_store_are_adopted() -> None:
    """Redis and PostgreSQL keep a point's time to the millisecond: the successor's points,
    read back, still go on from the handler's own (which were overwritten when compared
    exactly)."""
    own = replace(
        pending("k", "handler"), checkpoints=(Checkpoint("charged", {"ref": 1}, 1.0001234),)
    )
    read_back = replace(
        own,
        owner_token="successor",
        checkpoints=(Checkpoint("charged", {"ref": 1}, 1.0), Checkpoint("refunded", None, 2.0)),
    )
    adopted = _going_on_from(own, read_back)
    assert [point.name for point in adopted.checkpoints] == ["charged", "refunded"]
    assert adopted.owner_token == "handler"
