"""Keys belong to a user or tenant: one client's key never reads another's response."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
from tests.support.guarded import make_client


def build(runs: Counter[str]) -> Starlette:
    @idempotent()
    async def pay(request: Request) -> Response:
        runs["pay"] += 1
        return JSONResponse({"n": runs["pay"], "user": request.headers.get("x-user")})

    return Starlette(routes=[Route("/pay", pay, methods=["POST"])])


class HeaderAuth(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        user = conn.headers.get("x-user")
        return (AuthCredentials(["authenticated"]), SimpleUser(user)) if user else None


async def test_authenticated_user_scopes_keys() -> None:
    runs: Counter[str] = Counter()
    app = build(runs)
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=HeaderAuth())  # wraps ours
    client = make_client(app)
    alice = await client.post("/pay", headers={"Idempotency-Key": "k", "x-user": "alice"})
    bob = await client.post("/pay", headers={"Idempotency-Key": "k", "x-user": "bob"})
    alice_again = await client.post("/pay", headers={"Idempotency-Key": "k", "x-user": "alice"})
    assert alice.json()["user"] == "alice"
    assert bob.json() == {"n": 2, "user": "bob"}
    assert alice_again.json() == alice.json()
    assert alice_again.headers["x-idempotent-replay"] == "true"
    assert sorted(key.split(":")[0] for key in store.records()) == ["alice", "bob"]


async def test_key_scope_callable_sync_and_async() -> None:
    def by_tenant(conn: HTTPConnection) -> str | None:
        return conn.headers.get("x-tenant")

    async def by_tenant_async(conn: HTTPConnection) -> str | None:
        return conn.headers.get("x-tenant")

    for key_scope in (by_tenant, by_tenant_async):
        runs: Counter[str] = Counter()
        app = build(runs)
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=key_scope)
        client = make_client(app)
        for tenant in ("t1", "t2", "t1:x", "t1"):
            await client.post("/pay", headers={"Idempotency-Key": "k", "x-tenant": tenant})
        assert runs["pay"] == 3


async def test_scope_and_key_with_colons_never_collide() -> None:
    runs: Counter[str] = Counter()
    app = build(runs)
    app.add_middleware(
        IdempotencyMiddleware,
        store=MemoryStore(),
        key_scope=lambda conn: conn.headers.get("x-tenant"),
    )
    client = make_client(app)
    await client.post("/pay", headers={"Idempotency-Key": "b:c", "x-tenant": "a"})
    other = await client.post("/pay", headers={"Idempotency-Key": "c", "x-tenant": "a:b"})
    assert "x-idempotent-replay" not in other.headers
    assert runs["pay"] == 2


async def test_anonymous_users_behind_authentication_are_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: Counter[str] = Counter()
    app = build(runs)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    app.add_middleware(AuthenticationMiddleware, backend=HeaderAuth())
    client = make_client(app)
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        await client.post("/pay", headers={"Idempotency-Key": "k1", "x-user": "alice"})
        assert not caplog.records  # authenticated: scoped, nothing to say
        await client.post("/pay", headers={"Idempotency-Key": "k2"})
        await client.post("/pay", headers={"Idempotency-Key": "k3"})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "unauthenticated requests are not scoped" in warnings[0]
