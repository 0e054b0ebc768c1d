"""The store check at startup: logged, refused with check_store="fail", skipped with "off"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from starlette.applications import Starlette
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Message

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyError,
    IdempotencyMiddleware,
    MemoryStore,
    StoreError,
    idempotent,
)
from starlette_idempotency import _store_check as store_check_module
from starlette_idempotency._store_check import REFUSED_STARTUP
from starlette_idempotency.stores.base import StoreFinding
from tests.support.records import pending


class SelfCheckingStore(MemoryStore):
    """A store of the user's own that reports on itself (the CheckableStore protocol)."""

    def __init__(self, findings: list[StoreFinding], *, hang: bool = False) -> None:
        super().__init__()
        self.findings = findings
        self.hang = hang
        self.checks = 0

    def describe(self) -> str:
        return "selfcheck at 10.0.0.1:1"

    async def check(self) -> list[StoreFinding]:
        self.checks += 1
        if self.hang:
            await asyncio.Event().wait()
        return self.findings


def app_with(store: MemoryStore, **options: Any) -> Starlette:
    app = Starlette()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)
    return app


def run_startup(app: Starlette) -> Message:
    """Run the app's lifespan startup (and shutdown) as a server would; the startup's answer,
    with the refusal's own message in it when the startup was refused.

    A refused startup also ends the app with the refusal raised (as Starlette ends a failed
    startup); the message servers log only points to the one the library logged."""
    sent: list[Message] = []
    raised: list[IdempotencyError] = []

    async def main() -> None:
        messages: Iterator[Message] = iter(
            [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
        )

        async def receive() -> Message:
            return next(messages)

        async def send(message: Message) -> None:
            sent.append(message)

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        try:
            await app(scope, receive, send)
        except IdempotencyError as exc:
            raised.append(exc)

    asyncio.run(main())
    if sent[0]["type"] == "lifespan.startup.failed":
        assert sent[0]["message"] == REFUSED_STARTUP
        assert len(raised) == 1
        assert len(sent) == 1, sent  # the shutdown the middleware asked for is not sent on
        return {**sent[0], "message": str(raised[0])}
    assert not raised
    return sent[0]


def start(app: Starlette) -> str:
    return str(run_startup(app)["type"])


UNREACHABLE = StoreFinding("error", "selfcheck at 10.0.0.1:1 is unreachable: refused")
EVICTING = StoreFinding("warning", "maxmemory-policy allkeys-lru can evict records")


def test_findings_are_logged_at_startup(caplog: pytest.LogCaptureFixture) -> None:
    store = SelfCheckingStore([UNREACHABLE, EVICTING])
    with caplog.at_level(logging.WARNING):
        assert start(app_with(store)) == "lifespan.startup.complete"
    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("ERROR", f"idempotency store check: {UNREACHABLE.message}") in logged
    assert ("WARNING", f"idempotency store check: {EVICTING.message}") in logged
    assert store.checks == 1


def test_fail_refuses_to_start_on_an_error() -> None:
    store = SelfCheckingStore([UNREACHABLE])
    assert start(app_with(store, check_store="fail")) == "lifespan.startup.failed"


def test_fail_starts_with_warnings_only() -> None:
    store = SelfCheckingStore([EVICTING])
    assert start(app_with(store, check_store="fail")) == "lifespan.startup.complete"


def test_off_skips_the_check() -> None:
    store = SelfCheckingStore([UNREACHABLE])
    assert start(app_with(store, check_store="off")) == "lifespan.startup.complete"
    assert store.checks == 0


def test_a_hanging_check_counts_as_unreachable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(store_check_module, "CHECK_TIMEOUT_SECONDS", 0.05)
    store = SelfCheckingStore([], hang=True)
    with caplog.at_level(logging.ERROR):
        assert start(app_with(store)) == "lifespan.startup.complete"
    assert any("is unreachable: no answer within 0.05s" in r.getMessage() for r in caplog.records)


def test_unknown_policy_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="check_store must be one of 'warn', 'fail'"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), check_store="loud")  # type: ignore[arg-type]


def failed_startup(app: Starlette) -> str:
    """The message of a refused startup."""
    answer = run_startup(app)
    assert answer["type"] == "lifespan.startup.failed", answer
    return str(answer["message"])


def fastapi_app(**options: Any) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), check_store="off", **options)
    return app


def test_idempotent_on_a_route_whose_methods_are_not_guarded_refuses_to_start() -> None:
    app = fastapi_app()

    @app.get("/items")
    @idempotent()
    async def items() -> list[int]:
        return []

    message = failed_startup(app)
    assert "@idempotent on /items (GET) does nothing" in message
    assert "IdempotencyMiddleware(methods=...)" in message


def test_idempotent_above_the_route_decorator_refuses_to_start() -> None:
    app = fastapi_app()
    router = APIRouter(prefix="/v1")

    @idempotent()
    @router.post("/pay")
    async def pay() -> dict[str, int]:
        return {}

    app.include_router(router)
    message = failed_startup(app)
    assert "@idempotent is above the route decorator on /v1/pay" in message


def test_a_lock_longer_than_the_middlewares_retention_refuses_to_start() -> None:
    app = fastapi_app(ttl_hours=0.01)

    @app.post("/pay")
    @idempotent(lock_ttl_seconds=60)
    async def pay() -> dict[str, int]:
        return {}

    assert "@idempotent on /pay: lock_ttl_seconds (60 s) must not exceed" in failed_startup(app)


def test_well_placed_routes_start() -> None:
    app = fastapi_app(methods=["POST", "PUT"])

    @app.put("/pay")
    @idempotent
    async def pay() -> dict[str, int]:
        return {}

    assert start(app) == "lifespan.startup.complete"


async def test_a_refused_startup_ends_the_app_and_runs_its_shutdown() -> None:
    """A server that waits for the app to end after a failed startup, as Starlette's
    TestClient does, gets the refusal raised instead of waiting for ever; the app's own
    shutdown closes what its startup opened."""
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        events.append("opened")
        yield
        events.append("closed")

    app = Starlette(lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware, store=SelfCheckingStore([UNREACHABLE]), check_store="fail"
    )
    sent: list[Message] = []
    asked = asyncio.Event()

    async def receive() -> Message:
        if not asked.is_set():
            asked.set()
            return {"type": "lifespan.startup"}
        await asyncio.Event().wait()  # the server asks nothing more of a failed app
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    with pytest.raises(StoreError, match="check_store='fail'"):
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert [message["type"] for message in sent] == ["lifespan.startup.failed"]
    assert events == ["opened", "closed"]


async def test_without_a_lifespan_the_first_request_logs_what_startup_would_refuse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = fastapi_app()

    @app.get("/items")
    @idempotent()
    async def items() -> list[int]:
        return []

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        with caplog.at_level(logging.ERROR):
            for _ in range(2):
                assert (await client.get("/items")).status_code == 200
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1, logged
    assert "@idempotent on /items (GET) does nothing" in logged[0]


def test_a_class_endpoint_method_the_middleware_does_not_guard_refuses_the_startup() -> None:
    class Items(HTTPEndpoint):
        @idempotent()
        async def put(self, request: Request) -> Response:
            return Response()

        @idempotent()
        async def post(self, request: Request) -> Response:
            return Response()

    app = Starlette(routes=[Route("/items", Items)])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    answer = run_startup(app)
    assert answer["type"] == "lifespan.startup.failed"
    assert answer["message"].startswith("@idempotent on /items (PUT) does nothing")
    assert "(POST)" not in answer["message"]


# --- every method of a decorated route, every mounted app (#30) -----------------------------


async def upsert(request: Request) -> Response:
    return Response(status_code=201)


def test_a_decorated_route_serving_an_unguarded_method_too_refuses_to_start() -> None:
    app = Starlette(routes=[Route("/items", idempotent()(upsert), methods=["POST", "PUT"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), check_store="off")
    message = failed_startup(app)
    assert "@idempotent on /items serves POST, PUT" in message
    assert "its PUT requests would run unguarded" in message
    assert "Split the route" in message
    assert "IdempotencyMiddleware(methods=[...]) with PUT added" in message


def test_a_route_whose_every_method_is_guarded_starts() -> None:
    app = Starlette(routes=[Route("/items", idempotent()(upsert), methods=["POST", "PUT"])])
    app.add_middleware(
        IdempotencyMiddleware, store=MemoryStore(), check_store="off", methods=["POST", "PUT"]
    )
    assert start(app) == "lifespan.startup.complete"


def sub_app(**options: Any) -> Starlette:
    """An app mounted by another, with its own middleware: Starlette sends it no lifespan."""
    return Starlette(
        routes=[Route("/items", idempotent()(upsert), methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), **options)],
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"on_store_eror": "fail_open"}, "'on_store_eror' (did you mean 'on_store_error'?)"),
        ({"methods": ["PUT"]}, "@idempotent on /items (POST) does nothing"),
    ],
    ids=["option", "route"],
)
def test_the_middleware_of_a_mounted_app_is_checked_at_the_outer_startup(
    options: dict[str, Any], expected: str
) -> None:
    app = Starlette(
        routes=[Mount("/v2", app=Starlette(routes=[Mount("/sub", sub_app(**options))]))]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), check_store="off")
    message = failed_startup(app)
    assert "the IdempotencyMiddleware of the app mounted at /v2/sub:" in message
    assert expected in message


def test_a_well_configured_mounted_app_starts() -> None:
    app = Starlette(routes=[Mount("/sub", sub_app())])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), check_store="off")
    assert start(app) == "lifespan.startup.complete"


async def test_without_a_lifespan_an_unguarded_method_refuses_every_request() -> None:
    """A mounted app's middleware hears no lifespan: its first request finds what startup
    would refuse, and requests are refused with the cause, never run unguarded."""
    runs: list[str] = []

    async def items(request: Request) -> Response:
        runs.append(request.method)
        return Response(status_code=201)

    sub = Starlette(
        routes=[Route("/items", idempotent()(items), methods=["POST", "PUT"])],
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
    )
    app = Starlette(routes=[Mount("/sub", sub)])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        for method in ("PUT", "POST", "PUT"):
            with pytest.raises(ConfigurationError, match="its PUT requests would run unguarded"):
                await client.request(method, "/sub/items", headers={"Idempotency-Key": "k"})
    assert runs == []


def test_two_routes_naming_one_operation_refuse_to_start() -> None:
    async def other(request: Request) -> Response:
        return Response(status_code=201)

    app = Starlette(
        routes=[
            Route("/items", idempotent(operation="items.put")(upsert), methods=["POST"]),
            Route("/things", idempotent(operation="items.put")(other), methods=["POST"]),
            Route("/patch", idempotent(operation="items.put")(upsert), methods=["PATCH"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), check_store="off")
    message = failed_startup(app)
    assert "@idempotent(operation='items.put') names two routes, POST /items and POST " in message
    assert "Give each its own operation" in message
    assert "PATCH" not in message  # another method is another key


@pytest.mark.parametrize("operation", ["", "a b", "x" * 201, 7])
def test_an_operation_is_a_short_visible_name(operation: Any) -> None:
    with pytest.raises(ConfigurationError, match="operation names what the route does"):
        idempotent(operation=operation)


# --- closing the store's own connections when the lifespan ends ----------------------------


class OwningStore(MemoryStore):
    """A store that opened its connections itself (``ConnectionOwningStore``), or was handed
    them (``owns_connections=False``); ``aclose`` says when it ran, among the lifespan's
    messages to the server."""

    def __init__(self, sent: list[str], *, owns: bool = True, fails: bool = False) -> None:
        super().__init__()
        self.sent = sent
        self.owns = owns
        self.fails = fails

    @property
    def owns_connections(self) -> bool:
        return self.owns

    def reopen(self) -> None:
        self.sent.append("reopen")

    async def aclose(self) -> None:
        self.sent.append("aclose")
        if self.fails:
            raise StoreError("the connection broke while closing")


def lifespan_messages(app: Starlette, sent: list[str]) -> None:
    """Run the app's lifespan (startup, then shutdown) as a server does, noting the messages
    it sends in ``sent``."""

    async def main() -> None:
        messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])

        async def receive() -> Message:
            return next(messages)

        async def send(message: Message) -> None:
            sent.append(message["type"])

        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        with contextlib.suppress(IdempotencyError):
            await app(scope, receive, send)

    asyncio.run(main())


def test_a_store_that_owns_its_connections_is_closed_before_the_shutdown_completes() -> None:
    sent: list[str] = []
    lifespan_messages(app_with(OwningStore(sent), check_store="off"), sent)
    assert sent == ["reopen", "lifespan.startup.complete", "aclose", "lifespan.shutdown.complete"]


def test_an_app_started_again_lets_the_store_open_again() -> None:
    sent: list[str] = []
    app = app_with(OwningStore(sent), check_store="off")
    lifespan_messages(app, sent)
    lifespan_messages(app, sent)
    assert sent.count("reopen") == 2
    assert sent[4:] == [
        "reopen",
        "lifespan.startup.complete",
        "aclose",
        "lifespan.shutdown.complete",
    ]


def test_a_store_given_its_connections_is_left_to_the_app() -> None:
    sent: list[str] = []
    lifespan_messages(app_with(OwningStore(sent, owns=False), check_store="off"), sent)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_a_memory_store_keeps_its_records_when_the_app_stops() -> None:
    store = MemoryStore()
    app = app_with(store, check_store="off")
    sent: list[str] = []
    asyncio.run(store.try_acquire("k", pending("k"), 30))
    lifespan_messages(app, sent)
    assert asyncio.run(store.get("k")) is not None


def test_a_refused_startup_closes_the_store_before_the_server_hears_of_it() -> None:
    @idempotent()
    async def items(request: Request) -> Response:
        return Response()

    sent: list[str] = []
    app = Starlette(routes=[Route("/items", items)])  # GET: the middleware does not guard it
    app.add_middleware(IdempotencyMiddleware, store=OwningStore(sent), check_store="off")
    lifespan_messages(app, sent)
    assert sent == ["reopen", "aclose", "lifespan.startup.failed"]


def test_a_failed_startup_of_the_app_closes_the_store() -> None:
    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("the app's own startup failed")
        yield

    sent: list[str] = []
    app = Starlette(lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, store=OwningStore(sent), check_store="off")
    with pytest.raises(RuntimeError, match="the app's own startup failed"):
        lifespan_messages(app, sent)
    assert sent == ["reopen", "aclose", "lifespan.startup.failed"]


def test_a_store_that_fails_to_close_is_logged_and_the_app_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[str] = []
    with caplog.at_level(logging.WARNING):
        lifespan_messages(app_with(OwningStore(sent, fails=True), check_store="off"), sent)
    assert sent == ["reopen", "lifespan.startup.complete", "aclose", "lifespan.shutdown.complete"]
    assert any(
        "closing its connections failed" in r.getMessage()
        and "broke while closing" in r.getMessage()
        for r in caplog.records
    )


class MisconfiguredStore(SelfCheckingStore):
    async def check(self) -> list[StoreFinding]:
        raise ConfigurationError("PostgresStore has no pool: hand it yours with use_pool")


def test_a_store_that_cannot_work_as_configured_refuses_the_startup_whatever_the_policy() -> None:
    store = MisconfiguredStore([])
    assert failed_startup(app_with(store, check_store="warn")).startswith(
        "PostgresStore has no pool"
    )
