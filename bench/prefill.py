"""Filling a MemoryStore with live records before a load run (``GET /__prefill?n=``).

The records are the real thing: one ``POST /payments`` goes through the app's whole stack, its
completed record is read back with the store's public ``get``, and each of the ``n`` keys is
then acquired and completed through the store's public ``try_acquire`` and ``complete`` (the
calls the middleware makes), each with its own copy of that record (``pickle.loads``: the same
objects, freshly allocated, so the garbage collector has as much to walk as after ``n`` real
requests). Going through the store rather than the app costs ~10 µs per record instead of
~100 µs, so 500,000 records take seconds, not a minute. The answer says how many objects the
collector tracks per prefilled record and per real request, so the two can be compared.

Afterwards the collector runs once (``gc.collect()``): the records sit in the oldest
generation, as in a server that has been up for a while, before the load starts. A second,
timed ``gc.collect()`` says what one full collection over that heap costs.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import time
import uuid
from typing import TYPE_CHECKING, Any

from bench.asgi import call
from bench.requests import PAYMENT_PATH

if TYPE_CHECKING:
    from fastapi import FastAPI

    from starlette_idempotency import MemoryStore

LOCK_TTL_SECONDS = 30.0  # the middleware's default lock_ttl_seconds
TTL_SECONDS = 24 * 3600.0  # the middleware's default ttl_hours, in seconds
_PROBE_REQUESTS = 200


async def _tracked_per_request(app: FastAPI, body: bytes, tag: str) -> float:
    """Objects the collector tracks that one real request leaves behind (its record)."""
    gc.collect()
    before = len(gc.get_objects())
    for i in range(_PROBE_REQUESTS):
        reply = await call(app, key=f"{tag}-probe-{i}", body=body)
        if reply.status != 201:
            raise RuntimeError(f"probe request answered {reply.status}: {reply.body[:200]!r}")
    gc.collect()
    return (len(gc.get_objects()) - before) / _PROBE_REQUESTS


async def prefill_memory_store(
    app: FastAPI, store: MemoryStore, n: int, body: bytes
) -> dict[str, Any]:
    """Put ``n`` live completed records in ``store``, the MemoryStore behind ``app``.

    ``body`` is what the app's ``POST /payments`` takes; what it did comes back as JSON."""
    from starlette_idempotency import storage_key

    started = time.perf_counter()
    tag = f"prefill-{uuid.uuid4().hex[:8]}"
    template_key = f"{tag}-template"
    reply = await call(app, key=template_key, body=body)
    if reply.status != 201:
        raise RuntimeError(f"template request answered {reply.status}: {reply.body[:200]!r}")
    # The storage key of an unscoped request (no key_scope, no authenticated user).
    template = await store.get(storage_key("", "POST", PAYMENT_PATH, template_key))
    if template is None:
        raise RuntimeError(
            "prefill: the template request's record is not under storage_key('', 'POST', "
            f"{PAYMENT_PATH!r}, key): the middleware's storage keys changed"
        )
    per_request = await _tracked_per_request(app, body, tag)
    blob = pickle.dumps(template)
    live_before = len(store)
    gc.collect()
    tracked_before = len(gc.get_objects())
    for i in range(n):
        key = storage_key("", "POST", PAYMENT_PATH, f"{tag}-{i:07d}")
        acquired = await store.try_acquire(key, template, LOCK_TTL_SECONDS)
        if not acquired.acquired:
            raise RuntimeError(f"prefill: could not acquire {key!r}")
        if not await store.complete(key, pickle.loads(blob), TTL_SECONDS):
            raise RuntimeError(f"prefill: could not complete {key!r}")
        if i % 20_000 == 0:
            await asyncio.sleep(0)  # let the server breathe (nobody is loading it yet)
    gc.collect()  # promotes the records to the oldest generation
    tracked_after = len(gc.get_objects())
    full = time.perf_counter()
    gc.collect()  # timed: one full collection over everything the process now holds
    full_ms = (time.perf_counter() - full) * 1000
    live = len(store)
    if live - live_before != n:
        raise RuntimeError(f"prefill: the store holds {live - live_before} new records, not {n}")
    return {
        "records": n,
        "live_records": live,
        "seconds": time.perf_counter() - started,
        "tracked_per_prefilled_record": (tracked_after - tracked_before) / max(1, n),
        "tracked_per_real_request": per_request,
        "tracked_objects": tracked_after,
        "full_collection_ms": full_ms,
    }
