"""Wire compatibility with other idempotency implementations: the replay header's name
(``X-Idempotent-Replay`` by default, Stripe's ``Idempotent-Replayed`` on request)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client

KEY = {"Idempotency-Key": "k"}


def payments(**options: Any) -> Any:
    """``POST /pay`` guarded; its answer carries both replay header names, as an app that
    copied a peer's response might."""
    runs = []

    @idempotent()
    async def pay(request: Request) -> Response:
        runs.append(1)
        headers = {"Idempotent-Replayed": "false", "X-Idempotent-Replay": "false"}
        return JSONResponse({"run": len(runs)}, status_code=201, headers=headers)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    return make_client(IdempotencyMiddleware(app, store=MemoryStore(), **options))


async def test_the_default_replay_header_is_x_idempotent_replay() -> None:
    client = payments()
    first = await client.post("/pay", headers=KEY)
    replay = await client.post("/pay", headers=KEY)
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert replay.headers.get_list("x-idempotent-replay") == ["true"]  # the app's own not kept
    assert replay.headers["idempotent-replayed"] == "false"  # any other header is the app's


async def test_stripes_replay_header_name() -> None:
    client = payments(replay_header_name="Idempotent-Replayed")
    first = await client.post("/pay", headers=KEY)
    assert first.headers["idempotent-replayed"] == "false"  # the first answer is the app's
    replay = await client.post("/pay", headers=KEY)
    assert (replay.status_code, replay.content) == (first.status_code, first.content)
    assert replay.headers.get_list("idempotent-replayed") == ["true"]
    assert replay.headers["x-idempotent-replay"] == "false"


async def test_the_openapi_documents_the_configured_replay_header() -> None:
    app = FastAPI()

    @app.post("/pay", status_code=201)
    @idempotent()
    async def pay() -> dict[str, int]:
        return {}

    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), replay_header_name="Idempotent-Replayed"
    )
    async with make_client(app) as client:
        schema = (await client.get("/openapi.json")).json()
    operation = schema["paths"]["/pay"]["post"]
    assert "Idempotent-Replayed" in operation["responses"]["201"]["headers"]
    assert "X-Idempotent-Replay" not in operation["responses"]["201"]["headers"]
    (key,) = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    assert "`Idempotent-Replayed: true`" in key["description"]
