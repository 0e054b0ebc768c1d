"""Every deprecated name and spelling still works, warns, and names the release that removes it."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from types import ModuleType

import pytest
from starlette.applications import Starlette

import starlette_idempotency
import starlette_idempotency.middleware
import starlette_idempotency.stores
from starlette_idempotency import IdempotencyMiddleware, MemoryStore
from starlette_idempotency._deprecation import REMOVED_IN
from starlette_idempotency.stores import FencedWrite, IdempotencyRecord
from tests.support.records import finished, pending

REMOVAL = "removed in " + re.escape(REMOVED_IN)


def test_the_removal_release_is_a_later_one() -> None:
    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("."))

    assert release(REMOVED_IN) > release(starlette_idempotency.__version__)


@pytest.mark.parametrize(
    ("module", "name", "home"),
    [
        (starlette_idempotency, "AcquireResult", starlette_idempotency.stores),
        (starlette_idempotency, "Checkpoint", starlette_idempotency.stores),
        (starlette_idempotency, "IdempotencyRecord", starlette_idempotency.stores),
        (starlette_idempotency, "RecordStatus", starlette_idempotency.stores),
        (starlette_idempotency, "IdempotencyPolicy", starlette_idempotency.middleware),
        (starlette_idempotency.stores, "IdempotencyPolicy", starlette_idempotency.middleware),
        (starlette_idempotency.stores, "MemoryStore", starlette_idempotency),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
def test_a_moved_name_resolves_from_its_old_home_with_a_warning(
    module: ModuleType, name: str, home: ModuleType
) -> None:
    assert name not in module.__all__
    with pytest.warns(DeprecationWarning, match=rf"import {name} from .*; it is {REMOVAL}"):
        moved = getattr(module, name)
    assert moved is getattr(home, name)
    assert name in home.__all__


class FirstSpellingStore(MemoryStore):
    """A store written for the protocol's first spelling: it overrides complete()."""

    async def complete(self, key: str, record: IdempotencyRecord, ttl: float) -> FencedWrite:
        return await self.finish(key, record, ttl)


def test_a_store_overriding_complete_warns_when_the_middleware_is_built() -> None:
    with pytest.warns(
        DeprecationWarning, match=rf"FirstSpellingStore overrides complete\(\).*; it is {REMOVAL}"
    ):
        IdempotencyMiddleware(Starlette(), store=FirstSpellingStore())


def test_a_store_of_finish_alone_builds_without_a_warning() -> None:
    IdempotencyMiddleware(Starlette(), store=MemoryStore())  # warnings are errors here


@pytest.mark.parametrize("spelling", ["complete", "fail"])
async def test_calling_complete_or_fail_warns_and_finishes(spelling: str) -> None:
    store = MemoryStore()
    record = pending("k")
    assert (await store.try_acquire("k", record, 30)).acquired
    with pytest.warns(DeprecationWarning, match=rf"MemoryStore\.{spelling}\(\).*{REMOVAL}"):
        written = await getattr(store, spelling)("k", finished(record), 60)
    assert written is FencedWrite.WRITTEN


@pytest.mark.parametrize("module", ["redis_server", "postgres_server"])
def test_the_launchers_of_0_1_import_with_a_warning(module: str) -> None:
    # A fresh interpreter: the module warns once, when it is first imported.
    name = f"starlette_idempotency.testing.{module}"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", f"import {name}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert f"{name} is private" in done.stderr
    assert f"removed in {REMOVED_IN}" in done.stderr
    with pytest.warns(DeprecationWarning, match=REMOVAL):
        old = importlib.reload(importlib.import_module(name))
    private = importlib.import_module(f"starlette_idempotency.testing._{module}")
    assert all(getattr(old, n) is getattr(private, n) for n in old.__all__)
