"""Keys belong to a user or tenant: one client's key never reads another's response."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    BaseUser,
    SimpleUser,
)
from starlette.exceptions import HTTPException
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import ConfigurationError, IdempotencyMiddleware, MemoryStore, idempotent
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


class NamedUser(BaseUser):
    """A user with a display name and no identity (``BaseUser.identity`` raises)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.name


class IdentifiedUser(NamedUser):
    def __init__(self, name: str, identity: object) -> None:
        super().__init__(name)
        self._identity = identity

    @property
    def identity(self) -> str:
        return self._identity  # type: ignore[return-value]  # a falsy id (0) is one too


class Member(SimpleUser):
    """A SimpleUser whose identity is its member id: its username need not be unique."""

    def __init__(self, username: str, member_id: str) -> None:
        super().__init__(username)
        self.member_id = member_id

    @property
    def identity(self) -> str:
        return self.member_id


class Unloaded(SimpleUser):
    """A SimpleUser whose identity reads an account that is not loaded."""

    @property
    def identity(self) -> str:
        account: Any = None
        return str(account.id)  # AttributeError, from inside the property


class UserFromHeaders(AuthenticationBackend):
    """``x-name`` as the display name; ``x-id``, when sent, as the identity."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser]:
        name, identity = conn.headers["x-name"], conn.headers.get("x-id")
        user: BaseUser
        if "x-member" in conn.headers:
            user = Member(name, conn.headers["x-member"])
        elif "x-unloaded" in conn.headers:
            user = Unloaded(name)
        else:
            user = NamedUser(name) if identity is None else IdentifiedUser(name, int(identity))
        return AuthCredentials(["authenticated"]), user


def authenticated(runs: Counter[str]) -> tuple[Starlette, MemoryStore]:
    app = build(runs)
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    app.add_middleware(AuthenticationMiddleware, backend=UserFromHeaders())
    return app, store


async def test_two_users_of_one_name_never_share_keys() -> None:
    """A display name is no identity: two accounts named alike would read each other's
    stored responses. A user with an identity (0 is one) is scoped by it; one without is
    refused with what to change."""
    runs: Counter[str] = Counter()
    app, store = authenticated(runs)
    client = make_client(app, raise_app_exceptions=False)
    smiths = [
        await client.post("/pay", headers={"Idempotency-Key": "k", "x-name": "J Smith", "x-id": i})
        for i in ("0", "1")
    ]
    assert [r.json()["n"] for r in smiths] == [1, 2]
    members = [
        await client.post("/pay", headers={"Idempotency-Key": "k", "x-name": "john", "x-member": m})
        for m in ("u_1", "u_2")
    ]
    assert [r.json()["n"] for r in members] == [3, 4]  # a SimpleUser's identity comes first
    assert sorted(key.split(":")[0] for key in store.records()) == ["0", "1", "u_1", "u_2"]
    with pytest.raises(ConfigurationError, match=r"has no identity.*key_scope="):
        await make_client(app).post("/pay", headers={"Idempotency-Key": "k", "x-name": "J Smith"})
    # An identity that fails is its error, not the username's to stand in for.
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'id'"):
        await make_client(app).post(
            "/pay", headers={"Idempotency-Key": "k", "x-name": "john", "x-unloaded": "1"}
        )
    assert runs["pay"] == 4


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


def bearer_user(conn: HTTPConnection) -> str:
    """A key_scope that decodes the bearer token, as the scope-keys guide suggests."""
    token = conn.headers.get("authorization", "").removeprefix("Bearer ")
    if not token.startswith("user-"):
        raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return token


async def test_an_http_exception_from_key_scope_is_the_apps_own_answer() -> None:
    runs: Counter[str] = Counter()
    starlette_app = build(runs)
    fastapi_app = FastAPI()

    @fastapi_app.post("/pay")
    @idempotent()
    async def pay(request: Request) -> dict[str, str]:
        runs["pay"] += 1
        return {"user": request.headers["authorization"]}

    for app, body in (
        (starlette_app, "invalid token"),
        (fastapi_app, '{"detail":"invalid token"}'),
    ):
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=bearer_user)
        client = make_client(app)
        for token in ("nope", ""):
            denied = await client.post(
                "/pay", headers={"Idempotency-Key": "k", "Authorization": f"Bearer {token}"}
            )
            assert denied.status_code == 401, denied.text
            assert denied.text == body
            assert denied.headers["www-authenticate"] == "Bearer"
        allowed = await client.post(
            "/pay", headers={"Idempotency-Key": "k", "Authorization": "Bearer user-1"}
        )
        assert allowed.status_code == 200
    assert runs["pay"] == 2


async def on_401(request: Request, exc: Exception) -> Response:
    return JSONResponse({"refused": str(exc)}, status_code=401)


async def server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"paged": True}, status_code=500)


@pytest.mark.parametrize(
    "handlers",
    [
        {401: on_401},
        {401: on_401, HTTPException: server_error},
        {Exception: server_error},
        {500: server_error},
    ],
    ids=["status", "status-before-class", "catch-all", "500"],
)
async def test_an_http_exception_from_key_scope_meets_the_handler_an_endpoints_would(
    handlers: dict[Any, Any],
) -> None:
    """Starlette answers an HTTPException with the handler for its status code first, and
    leaves the ``Exception`` and ``500`` handlers to errors nothing else answered."""

    async def check_token(request: Request) -> Response:
        return JSONResponse({"user": bearer_user(request)})

    @idempotent()
    async def pay(request: Request) -> Response:
        return JSONResponse({})

    app = Starlette(
        routes=[
            Route("/pay", pay, methods=["POST"]),
            Route("/check", check_token, methods=["POST"]),
        ],
        exception_handlers=handlers,
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=bearer_user)
    client = make_client(app)
    refused = await client.post("/pay", headers={"Idempotency-Key": "k"})
    endpoints_own = await client.post("/check")
    assert endpoints_own.status_code == 401
    assert (refused.status_code, refused.text) == (endpoints_own.status_code, endpoints_own.text)


async def test_any_other_error_in_key_scope_is_logged_with_its_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(conn: HTTPConnection) -> str:
        raise ValueError("token has expired")

    app = build(Counter())
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=broken)
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="token has expired"):
        await make_client(app).post("/pay", headers={"Idempotency-Key": "k"})
    logged = [r for r in caplog.records if r.name == "starlette_idempotency._keys"]
    assert len(logged) == 1
    assert "key_scope" in logged[0].getMessage()
    assert "POST /pay" in logged[0].getMessage()
    assert "raise an HTTPException" in logged[0].getMessage()
    assert logged[0].exc_info is not None
    assert "token has expired" in str(logged[0].exc_info[1])
