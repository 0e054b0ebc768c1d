"""The store of your own that docs/how-to/choose-a-store.md shows (``examples/custom_store.py``,
which also runs the contract suite): written from ``starlette_idempotency.stores`` alone, it
guards an app as the built-in stores do."""

from __future__ import annotations

import ast

from examples.custom_store import DictStore
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, idempotent, storage_key
from starlette_idempotency.stores import IdempotencyStore, RecordStatus
from tests.support.guarded import make_client
from tests.support.shown_files import ROOT, drifted, shown_files

PAGE = ROOT / "docs" / "how-to" / "choose-a-store.md"
MODULE = ROOT / "examples" / "custom_store.py"


def test_the_page_shows_the_store_verbatim() -> None:
    shown = shown_files(PAGE.read_text(encoding="utf-8"))
    assert list(shown) == [MODULE.relative_to(ROOT).as_posix()]
    assert drifted(PAGE, shown) == []


def test_the_store_imports_from_stores_alone() -> None:
    tree = ast.parse(MODULE.read_text(encoding="utf-8"))
    ours = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("starlette_idem")
    }
    imported = [node for node in ast.walk(tree) if isinstance(node, ast.Import)]
    assert ours == {"starlette_idempotency.stores"}
    assert [alias.name for node in imported for alias in node.names] == ["time"]


async def test_it_guards_an_app() -> None:
    runs = 0

    @idempotent()
    async def pay(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        return JSONResponse({"run": runs}, status_code=201)

    store = DictStore()
    assert isinstance(store, IdempotencyStore)
    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=store))
    headers = {"Idempotency-Key": "order-1"}

    first = await client.post("/pay", json={"amount": 1}, headers=headers)
    retry = await client.post("/pay", json={"amount": 1}, headers=headers)
    reused = await client.post("/pay", json={"amount": 2}, headers=headers)

    assert (first.status_code, first.json()) == (201, {"run": 1})
    assert (retry.status_code, retry.json()) == (201, {"run": 1})
    assert retry.headers["x-idempotent-replay"] == "true"
    assert reused.status_code == 422
    assert runs == 1
    record = await store.get(storage_key("", "POST", "/pay", "order-1"))
    assert record is not None
    assert record.status is RecordStatus.COMPLETED
