"""Every way an app can be wired: a request the app treats as guarded is guarded, or refused
with a message that says what to change; never run unguarded in silence.

Class endpoints, partials, bound methods, a path-rewriting middleware inside the guard, an app
without the middleware, decorators stacked above ``@idempotent``, apps mounted whole under
``protect_all``, the keys of requests the app tells apart (hosts, tenants, operations), and the
records a renamed handler keeps.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.endpoints import HTTPEndpoint
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Host, Match, Mount, Route, Router
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from starlette_idempotency import (
    IdempotencyMiddleware,
    MemoryStore,
    StoredResponse,
    idempotent,
    storage_key,
)
from starlette_idempotency._routing import decoration
from starlette_idempotency.errors import ConfigurationError, UnguardedRequestError
from starlette_idempotency.stores import IdempotencyRecord, RecordStatus
from tests.support.conditions import eventually
from tests.support.decorators import counting_wraps
from tests.support.guarded import make_client
from tests.support.routing import Rewriting

runs: Counter[str] = Counter()


def key() -> dict[str, str]:
    return {"Idempotency-Key": uuid.uuid4().hex}


def raising_client(app: ASGIApp) -> httpx.AsyncClient:
    """A client that lets the app's exceptions through, to see what refused a request."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


async def refusal(app: ASGIApp, url: str) -> str:
    """What refused a keyed POST to ``url`` that must not run unguarded."""
    async with raising_client(app) as client:
        with pytest.raises(UnguardedRequestError) as refused:
            await client.post(url, headers=key())
    return str(refused.value)


async def assert_guarded(client: httpx.AsyncClient, url: str, name: str, **kwargs: Any) -> None:
    """Twice with one key: one run and a replay; without a key: 400."""
    headers = {**key(), **kwargs.pop("headers", {})}
    before = runs[name]
    first = await client.post(url, headers=headers, **kwargs)
    retry = await client.post(url, headers=headers, **kwargs)
    keyless = await client.post(url, **kwargs)
    assert first.status_code == 201, first.text
    assert retry.headers.get("x-idempotent-replay") == "true", retry.text
    assert retry.content == first.content
    assert keyless.status_code == 400, keyless.text
    assert runs[name] == before + 1


# -- class endpoints and partials -------------------------------------------------------------


class Orders(HTTPEndpoint):
    @idempotent()
    async def post(self, request: Request) -> Response:
        runs["class"] += 1
        return JSONResponse({"run": runs["class"]}, status_code=201)

    async def get(self, request: Request) -> Response:
        return JSONResponse({"runs": runs["class"]})


@idempotent()
async def charge(request: Request, *, currency: str) -> Response:
    runs["partial"] += 1
    return JSONResponse({"run": runs["partial"], "currency": currency}, status_code=201)


async def test_a_class_endpoint_method_is_guarded() -> None:
    app = Starlette(routes=[Route("/orders", Orders)])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    await assert_guarded(client, "/orders", "class")
    assert (await client.get("/orders")).status_code == 200  # its undecorated GET runs as is


async def test_a_partial_endpoint_is_guarded() -> None:
    app = charges_app(Middleware(IdempotencyMiddleware, store=MemoryStore()))
    await assert_guarded(make_client(app), "/charges", "partial")


class Payments:
    """A service whose handlers are methods, routed bound to an instance or to the class."""

    @idempotent()
    async def create(self, request: Request) -> Response:
        runs["bound"] += 1
        return JSONResponse({"run": runs["bound"]}, status_code=201)

    @classmethod
    @idempotent()
    async def refund(cls) -> dict[str, int]:
        runs["classmethod"] += 1
        return {"run": runs["classmethod"]}


def bound_method_app() -> Starlette:
    return Starlette(routes=[Route("/payments", Payments().create, methods=["POST"])])


def classmethod_app() -> FastAPI:
    app = FastAPI()
    app.post("/payments", status_code=201)(Payments.refund)
    return app


@pytest.mark.parametrize(
    ("build", "name"),
    [(bound_method_app, "bound"), (classmethod_app, "classmethod")],
    ids=["starlette-bound-method", "fastapi-classmethod"],
)
def test_a_bound_method_endpoint_starts_and_is_guarded(
    build: Callable[[], Starlette], name: str
) -> None:
    """A bound method's ``__wrapped__`` is its function's, which leads past the wrapper to the
    undecorated function: followed, it took the decorator for one above the route decorator,
    and refused the startup and every request."""
    app = build()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    before = runs[name]
    with TestClient(app) as client:  # its lifespan runs the startup checks
        headers = key()
        first = client.post("/payments", headers=headers)
        retry = client.post("/payments", headers=headers)
    assert first.status_code == 201, first.text
    assert retry.headers.get("x-idempotent-replay") == "true", retry.text
    assert retry.content == first.content
    assert runs[name] == before + 1


class Region:
    """One instance per region, each routed with ``@idempotent`` applied to its bound method."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def pay(self, request: Request) -> Response:
        runs[f"region {self.name}"] += 1
        return JSONResponse({"region": self.name}, status_code=201)


def test_a_bound_method_takes_an_operation_of_its_own() -> None:
    """``idempotent(operation=...)(region.pay)``, one operation per instance, failed at import
    with ``AttributeError``: the options were set on the bound method, which takes none."""
    routes = [
        Route(f"/{name}/pay", idempotent(operation=f"{name}.pay")(region.pay), methods=["POST"])
        for name, region in (("eu", Region("eu")), ("us", Region("us")))
    ]
    app = Starlette(routes=routes)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    before = Counter(runs)
    with TestClient(app) as client:  # its lifespan runs the startup checks
        headers = key()
        answers = [client.post(f"/{name}/pay", headers=headers) for name in ("eu", "us", "eu")]
    assert [answer.json() for answer in answers] == [{"region": n} for n in ("eu", "us", "eu")]
    assert answers[2].headers.get("x-idempotent-replay") == "true"
    assert runs["region eu"] - before["region eu"] == runs["region us"] - before["region us"] == 1


async def test_idempotent_above_the_route_decorator_on_a_bound_method_is_refused() -> None:
    """The options of a bound method go on its wrapper, which nothing keeps in this order:
    the router held the undecorated method, and every request ran it unguarded."""
    app = FastAPI()
    region = Region("eu")
    idempotent(operation="eu.pay")(app.post("/pay")(region.pay))
    gc.collect()  # the wrapper, thrown away, is gone
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    before = runs["region eu"]
    async with raising_client(app) as client:
        with pytest.raises(ConfigurationError) as refused:
            await client.post("/pay", headers=key())
    assert "@idempotent is above the route decorator on /pay" in str(refused.value)
    assert runs["region eu"] == before
    app.post("/refund")(Region("eu").pay)  # the method of another instance: not decorated
    assert decoration(app.routes[-1].endpoint) == (None, None)  # type: ignore[attr-defined]


class PassingProxy:
    """A decorator object that passes for the function it wraps, as wrapt's ``FunctionWrapper``
    (OpenTelemetry's instrumentation, ``deprecated``) does: of its class, equal to it, with
    its hash, and its attributes read through."""

    def __init__(self, wrapped: Callable[..., Any]) -> None:
        self.__wrapped__ = wrapped

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __eq__(self, other: object) -> bool:
        return self.__wrapped__ == other

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)


@PassingProxy
@idempotent()
async def proxied(request: Request) -> Response:
    runs["proxied"] += 1
    return JSONResponse({"run": runs["proxied"]}, status_code=201)


async def test_a_proxy_above_idempotent_that_equals_it_is_looked_through() -> None:
    """The wrappers were found by equality, and such a proxy equals the wrapper: taken for it,
    it was the mark the guard set, and the wrapper, seeing another, refused every request."""
    app = Starlette(routes=[Route("/payments", proxied, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    await assert_guarded(make_client(app), "/payments", "proxied")


@dataclass
class Greeting:
    """An ASGI app a route serves as its endpoint: a dataclass instance, unhashable."""

    text: str

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"text": self.text})(scope, receive, send)


def test_an_unhashable_endpoint_is_served_as_without_the_middleware() -> None:
    """Looking it up among the wrappers raised ``TypeError``: the startup failed, and every
    request to the app, a GET to another route too, was answered 500."""
    app = Starlette(routes=[Route("/hello", Greeting("hi"), methods=["GET", "POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    with TestClient(app) as client:  # its lifespan runs the startup checks
        answers = [client.get("/hello"), client.post("/hello", headers=key())]
    assert [(answer.status_code, answer.json()) for answer in answers] == [
        (200, {"text": "hi"})
    ] * 2


# -- requests no guard saw --------------------------------------------------------------------


def charges_app(*middleware: Middleware) -> Starlette:
    endpoint = functools.partial(charge, currency="EUR")
    return Starlette(routes=[Route("/charges", endpoint, methods=["POST"])], middleware=middleware)


async def test_a_path_rewritten_inside_the_guard_is_refused_not_run_unguarded() -> None:
    app = charges_app(
        Middleware(IdempotencyMiddleware, store=MemoryStore()),  # outside: sees /v1/charges
        Middleware(Rewriting),
    )
    before = runs["partial"]
    message = await refusal(app, "/v1/charges")
    assert "tests.core.test_wiring.charge was not run for POST /charges" in message
    assert "found no guarded route" in message
    assert "rewrites the path" in message
    assert runs["partial"] == before
    await assert_guarded(make_client(app), "/charges", "partial")  # the path it knows


async def test_a_path_rewritten_outside_the_guard_is_guarded() -> None:
    app = charges_app(Middleware(Rewriting), Middleware(IdempotencyMiddleware, store=MemoryStore()))
    await assert_guarded(make_client(app), "/v1/charges", "partial")


@pytest.mark.parametrize(
    ("app", "url"),
    [(Starlette(routes=[Route("/orders", Orders)]), "/orders"), (charges_app(), "/charges")],
    ids=["class", "partial"],
)
async def test_a_decorated_route_in_an_app_without_the_middleware_is_refused(
    app: Starlette, url: str
) -> None:
    assert "no IdempotencyMiddleware saw" in await refusal(app, url)


class Payment(BaseModel):
    amount: int


def fastapi_payments(executions: Counter[str]) -> FastAPI:
    app = FastAPI()

    @app.post("/payments", status_code=201)
    @idempotent()
    async def pay(payment: Payment) -> dict[str, int]:
        executions["pay"] += 1
        return {"amount": payment.amount}

    @app.post("/refunds", status_code=201)
    @idempotent()
    def refund(payment: Payment, request: Request) -> dict[str, str]:
        executions["refund"] += 1
        return {"path": request.url.path}

    return app


async def test_fastapi_endpoints_without_the_middleware_are_refused_but_direct_calls_run() -> None:
    """An endpoint whose arguments hold the request is refused; one without a Request parameter
    cannot tell a router's call from a direct one (its signature is left alone), and runs."""
    executions: Counter[str] = Counter()
    app = fastapi_payments(executions)
    async with raising_client(app) as client:
        with pytest.raises(UnguardedRequestError, match="was not run for POST /refunds"):
            await client.post("/refunds", json={"amount": 1}, headers=key())
        assert executions == Counter()
        answer = await client.post("/payments", json={"amount": 1}, headers=key())
        assert answer.status_code == 201
    assert executions == Counter({"pay": 1})
    pay = next(r.endpoint for r in app.routes if isinstance(r, APIRoute) and r.path == "/payments")
    assert await pay(Payment(amount=3)) == {"amount": 3}  # a unit test's direct call
    assert executions == Counter({"pay": 2})


async def test_fastapi_endpoints_behind_the_middleware_run_once() -> None:
    executions: Counter[str] = Counter()
    app = fastapi_payments(executions)
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    headers = key()
    for _ in range(2):
        for url in ("/payments", "/refunds"):
            response = await client.post(url, json={"amount": 1}, headers=headers)
            assert response.status_code == 201, response.text
    assert executions == Counter({"pay": 1, "refund": 1})
    schema = (await client.get("/openapi.json")).json()
    parameters = schema["paths"]["/payments"]["post"].get("parameters", [])
    assert [p["name"] for p in parameters] == ["Idempotency-Key"]  # no request parameter


async def test_methods_the_middleware_does_not_guard_run_as_before() -> None:
    class Both(HTTPEndpoint):
        @idempotent()
        async def post(self, request: Request) -> Response:
            return Response(status_code=201)

        @idempotent()
        async def get(self, request: Request) -> Response:  # a GET: the decorator does nothing
            return Response("got")

    app = Starlette(routes=[Route("/both", Both)])
    guarded = IdempotencyMiddleware(app, store=MemoryStore(), methods=["POST"])
    async with raising_client(guarded) as client:
        assert (await client.get("/both")).text == "got"


def guarded_endpoint(name: str) -> Any:
    """An ``@idempotent`` endpoint that counts its runs as ``name``."""

    @idempotent()
    async def endpoint(request: Request) -> Response:
        runs[name] += 1
        return JSONResponse({"run": runs[name]}, status_code=201)

    return endpoint


class MethodOverride:
    """``X-HTTP-Method-Override``: the method the app routes the request as."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"x-http-method-override":
                scope = {**scope, "method": value.decode("latin-1")}
        await self.app(scope, receive, send)


async def test_a_method_overridden_inside_the_guard_is_refused_not_run_unguarded() -> None:
    """A PUT the guard passes on (it guards POST) that a middleware inside it turns into a
    POST reaches the decorated handler: refused, as the guard never saw it as a POST."""
    app = Starlette(routes=[Route("/pay", guarded_endpoint("override"), methods=["POST"])])
    app.add_middleware(MethodOverride)
    guarded = IdempotencyMiddleware(app, store=MemoryStore())
    async with raising_client(guarded) as client:
        with pytest.raises(UnguardedRequestError, match="changed its method"):
            await client.put("/pay", headers={**key(), "X-HTTP-Method-Override": "POST"})
    assert runs["override"] == 0


async def test_a_safe_method_overridden_on_a_copy_is_refused_for_a_handler_without_request() -> (
    None
):
    """A FastAPI handler without a ``Request`` parameter cannot see the method it runs for:
    the guard's scope says GET, a copy the router dispatched says POST. The router's mark on
    the guard's scope (its ``endpoint``) is missing, and the request is refused; a GET the
    router dispatched on the guard's own scope still runs."""
    app = FastAPI()

    @app.api_route("/pay", methods=["GET", "POST"])
    @idempotent()
    async def pay() -> dict[str, int]:
        runs["fastapi override"] += 1
        return {"run": runs["fastapi override"]}

    app.add_middleware(MethodOverride)  # on a copy of the scope
    guarded = IdempotencyMiddleware(app, store=MemoryStore())
    async with raising_client(guarded) as client:
        assert (await client.get("/pay")).json() == {"run": 1}
        with pytest.raises(UnguardedRequestError, match="handed the router a copy"):
            await client.get("/pay", headers={**key(), "X-HTTP-Method-Override": "POST"})
    assert runs["fastapi override"] == 1


async def test_a_route_added_after_startup_for_an_unguarded_method_is_refused() -> None:
    """The startup check refuses a decorated handler served for a method the middleware does
    not guard; one added later is refused as it runs, not run unguarded."""
    app = Starlette()
    guarded = IdempotencyMiddleware(app, store=MemoryStore())
    async with raising_client(guarded) as client:
        assert (await client.get("/")).status_code == 404  # the first request: no route yet
        app.add_route("/upsert", guarded_endpoint("late put"), methods=["PUT"])
        with pytest.raises(UnguardedRequestError, match="does not guard"):
            await client.put("/upsert", headers=key())
    assert runs["late put"] == 0


@pytest.mark.parametrize("method", ["post", "Post"])
async def test_a_guarded_method_in_another_case_is_refused(method: str) -> None:
    """A server may pass the method on as sent (uvicorn's h11 does), and an app mounted whole
    may upper-case it: under ``protect_all``, ``post`` would be run as an unguarded POST."""

    async def case_blind(scope: Scope, receive: Receive, send: Send) -> None:
        runs["case-blind"] += 1
        await JSONResponse({"method": scope["method"].upper()})(scope, receive, send)

    app = Starlette(routes=[Mount("/legacy", case_blind)])
    guarded = IdempotencyMiddleware(app, store=MemoryStore(), protect_all=True)
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: Message) -> None:
        sent.append(message)

    # As sent: httpx would upper-case the method.
    scope = {
        "type": "http",
        "method": method,
        "path": "/legacy/pay",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"idempotency-key", b"k")],
    }
    await guarded(scope, receive, send)
    assert sent[0]["status"] == 400
    assert b"send it in upper case" in sent[1]["body"]
    assert runs["case-blind"] == 0
    # Where no guarded route is, it goes on as sent (Starlette's router answers it 404).
    sent.clear()
    await guarded({**scope, "path": "/elsewhere"}, receive, send)
    assert sent[0]["status"] == 404


# -- decorators stacked above @idempotent ----------------------------------------------------


rate_limited = counting_wraps(runs)


def stacked_fastapi() -> FastAPI:
    app = FastAPI()

    @app.post("/payments", status_code=201)
    @rate_limited
    @idempotent(ttl_hours=48)
    async def pay(payment: Payment) -> dict[str, int]:
        runs["stacked pay"] += 1
        return {"run": runs["stacked pay"]}

    @app.post("/refunds", status_code=201)
    @rate_limited
    @rate_limited
    @idempotent()
    def refund(payment: Payment) -> dict[str, int]:  # sync: run in a thread, context copied
        runs["stacked refund"] += 1
        return {"run": runs["stacked refund"]}

    return app


async def test_a_wraps_decorator_above_idempotent_is_guarded_and_runs_once() -> None:
    app = stacked_fastapi()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    for url, name in (("/payments", "stacked pay"), ("/refunds", "stacked refund")):
        before, headers = runs[name], key()
        answers = [await client.post(url, json={"amount": 1}, headers=headers) for _ in range(2)]
        assert [answer.status_code for answer in answers] == [201, 201], answers[0].text
        assert answers[1].headers.get("x-idempotent-replay") == "true"
        assert runs[name] == before + 1
    schema = (await client.get("/openapi.json")).json()
    parameters = schema["paths"]["/payments"]["post"].get("parameters", [])
    assert [p["name"] for p in parameters] == ["Idempotency-Key"]


async def test_the_endpoint_finds_its_guard_through_middleware_that_runs_it_in_a_task() -> None:
    """``@app.middleware("http")`` inside the guard runs the endpoint in a task of its own,
    which copies the context the guard set."""
    app = stacked_fastapi()

    @app.middleware("http")
    async def timing(request: Request, call_next: Any) -> Any:
        return await call_next(request)

    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())  # added last: outermost
    client = make_client(app)
    before, headers = runs["stacked pay"], key()
    answers = [await client.post("/payments", json={"amount": 1}, headers=headers) for _ in "12"]
    assert [answer.status_code for answer in answers] == [201, 201], answers[0].text
    assert answers[1].headers.get("x-idempotent-replay") == "true"
    assert runs["stacked pay"] == before + 1


def offloaded(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A hand-written decorator that runs a blocking endpoint off the loop, in an executor:
    ``run_in_executor`` copies no context, so the endpoint runs without its guard's."""

    @functools.wraps(endpoint)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(endpoint, *args, **kwargs))

    return wrapper


class Amount(BaseModel):
    amount: int


async def test_an_endpoint_run_where_its_context_is_lost_runs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The endpoint found no guard in its context and took the call for a unit test's: it
    never reported its start, and the guard, taking its 200 for an answer from before the
    endpoint, freed the key, so every retry ran it again. A Starlette endpoint was refused,
    as though no guard had seen its request. The Starlette endpoint now finds its guard in
    its request; a FastAPI one's answer is kept, with a warning saying why."""
    fastapi = FastAPI()

    @fastapi.post("/payments")
    @offloaded
    @idempotent()
    def pay(body: Amount) -> dict[str, int]:
        runs["offloaded pay"] += 1
        return {"amount": body.amount}

    @offloaded
    @idempotent()
    def refund(request: Request) -> Response:
        runs["offloaded refund"] += 1
        return JSONResponse({}, status_code=201)

    starlette = Starlette(routes=[Route("/refunds", refund, methods=["POST"])])
    for app, url, name, status in (
        (fastapi, "/payments", "offloaded pay", 200),
        (starlette, "/refunds", "offloaded refund", 201),
    ):
        client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
        before, headers = runs[name], key()
        answers = [await client.post(url, json={"amount": 1}, headers=headers) for _ in "123"]
        assert [answer.status_code for answer in answers] == [status] * 3, answers[0].text
        assert [answer.headers.get("x-idempotent-replay") for answer in answers[1:]] == [
            "true",
            "true",
        ]
        assert runs[name] == before + 1
    [warning] = [record for record in caplog.records if "without its @idempotent" in record.message]
    assert "POST /payments answered 200" in warning.message
    assert "copy_context" in warning.message


class OneWorker:
    """A decorator above ``@idempotent`` that runs every call on one long-lived task, started
    by the first call (a per-process mutex): the task copies that first request's context."""

    def __init__(self) -> None:
        self._calls: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def __call__(self, endpoint: Callable[..., Awaitable[Any]]) -> Any:
        @functools.wraps(endpoint)
        async def serialized(*args: Any, **kwargs: Any) -> Any:
            if self.task is None:
                self.task = asyncio.create_task(self._work())
            answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            await self._calls.put((endpoint, args, kwargs, answer))
            return await answer

        return serialized

    async def _work(self) -> None:
        while True:
            endpoint, args, kwargs, answer = await self._calls.get()
            try:
                answer.set_result(await endpoint(*args, **kwargs))
            except Exception as exc:  # a refusal: the request's, not the worker's end
                answer.set_exception(exc)


@pytest.mark.parametrize("first_keyed", [True, False], ids=["first-keyed", "first-keyless"])
@pytest.mark.parametrize("first_running", [False, True], ids=["first-ended", "first-running"])
async def test_an_endpoint_run_by_a_task_an_earlier_request_started_is_guarded(
    first_running: bool, first_keyed: bool
) -> None:
    """The task's context is the first request's, whose scope the endpoint took for its guard:
    a request to another route was refused with a 500, and one to the same route marked the
    first request's start, not its own, so a 402 after its write freed the key and every retry
    ran the endpoint again. The first request may still run (its background task), or not;
    it may own no key (on a route that does not require one), as it told requests apart."""
    worker = OneWorker()
    first_done = asyncio.Event()

    async def send_welcome() -> None:
        if first_running:
            await first_done.wait()

    @worker
    @idempotent(required=False)
    async def open_account(request: Request) -> Response:
        runs["worker account"] += 1
        return JSONResponse({}, status_code=201, background=BackgroundTask(send_welcome))

    @worker
    @idempotent(required=False)
    async def charge(request: Request) -> Response:
        runs["worker charge"] += 1
        return JSONResponse({"declined": runs["worker charge"]}, status_code=402)

    routes = [Route("/accounts", open_account, methods=["POST"])]
    routes.append(Route("/charges", charge, methods=["POST"]))
    client = make_client(IdempotencyMiddleware(Starlette(routes=routes), store=MemoryStore()))
    first = asyncio.create_task(client.post("/accounts", headers=key() if first_keyed else {}))
    try:
        await eventually(lambda: worker.task is not None and runs["worker account"] > 0)
        if not first_running:
            assert (await first).status_code == 201
        keyless = await client.post("/charges")  # its guard holds no lease either
        before, headers = runs["worker charge"], key()
        answers = [await client.post("/charges", headers=headers) for _ in "123"]
    finally:
        first_done.set()
        assert (await first).status_code == 201
        assert worker.task is not None
        worker.task.cancel()
    assert keyless.status_code == 402, keyless.text
    assert [answer.status_code for answer in answers] == [402] * 3, answers[0].text
    assert [answer.headers.get("x-idempotent-replay") for answer in answers] == [
        None,
        "true",
        "true",
    ]
    assert runs["worker charge"] == before + 1


async def test_an_endpoint_without_request_run_by_a_task_of_an_ended_request_is_refused() -> None:
    """Without a Request among its arguments, nothing says which request it runs for: it ran
    without reporting its start, so a 402 after its write freed the key for every retry."""
    worker = OneWorker()
    app = FastAPI()

    @app.post("/accounts", status_code=201)
    @worker
    @idempotent()
    async def open_account(body: Amount) -> dict[str, int]:
        return {"amount": body.amount}

    @app.post("/charges", status_code=201)
    @worker
    @idempotent()
    async def charge(body: Amount) -> dict[str, int]:
        runs["worker charge without request"] += 1
        return {"amount": body.amount}

    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    try:
        assert (
            await client.post("/accounts", json={"amount": 1}, headers=key())
        ).status_code == 201
        with pytest.raises(UnguardedRequestError, match="runs in a task an earlier request"):
            await client.post("/charges", json={"amount": 1}, headers=key())
    finally:
        assert worker.task is not None
        worker.task.cancel()
    assert runs["worker charge without request"] == 0


async def test_a_direct_call_in_a_task_an_ended_request_started_runs_as_written() -> None:
    """A unit test's call with a Request of its own, in a task a request through the app
    started: no guard saw its request, so it runs, as a direct call does anywhere else."""
    worker = OneWorker()

    @worker
    @idempotent()
    async def refund(request: Request) -> Response:
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/refunds", refund, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    try:
        assert (await client.post("/refunds", headers=key())).status_code == 201
        own = Request({"type": "http", "method": "POST", "path": "/refunds", "headers": []})
        assert (await refund(own)).status_code == 201
    finally:
        assert worker.task is not None
        worker.task.cancel()


class FallbackToV2:
    """Outside the guard: a request its app answers 404 is dispatched again, the same scope
    under ``/v2``, with the body the first dispatch read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        read: list[Message] = []
        statuses: list[int] = []

        async def reading() -> Message:
            read.append(await receive())
            return read[-1]

        async def probing(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await self.app(scope, reading, probing)
        assert statuses == [404]
        scope["path"] = "/v2" + scope["path"]

        async def again() -> Message:
            return read.pop(0) if read else await receive()

        await self.app(scope, again, send)


async def test_a_scope_dispatched_again_through_the_guard_is_guarded() -> None:
    """The guard marked the scope ended as the first dispatch returned; the second one's
    endpoint then took its own guard's context for an ended request's and was refused."""
    app = FastAPI()

    @app.post("/v2/charges", status_code=201)
    @idempotent()
    async def charge(body: Amount) -> dict[str, int]:
        runs["charge v2"] += 1
        return {"amount": body.amount}

    client = make_client(FallbackToV2(IdempotencyMiddleware(app, store=MemoryStore())))
    before, headers = runs["charge v2"], key()
    answers = [await client.post("/charges", json={"amount": 1}, headers=headers) for _ in "12"]
    assert [answer.status_code for answer in answers] == [201, 201], answers[0].text
    assert answers[1].headers.get("x-idempotent-replay") == "true"
    assert runs["charge v2"] == before + 1


class TryMountedFirst:
    """Inside the outer guard: a request goes to the app mounted under ``/legacy`` first, and
    on its 404 to the same path under ``/v2``, in the same request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        statuses: list[int] = []

        async def unless_missing(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            if statuses != [404]:
                await send(message)

        await self.app(scope, receive, unless_missing)
        if statuses == [404]:
            scope["path"] = "/v2" + scope["path"].removeprefix("/legacy")
            await self.app(scope, receive, send)


async def test_a_guard_inside_that_ends_leaves_the_request_of_the_guard_outside() -> None:
    """The inner guard put its run on the scope both guards share and ended it: the endpoint
    the request reached next took its context for an ended request's, and was refused."""
    legacy = FastAPI()
    app = FastAPI()

    @app.get("/v2/items")
    @idempotent()
    async def items() -> dict[str, int]:  # decorated, served for a GET it passes on
        return {"items": 1}

    app.router.routes.append(Mount("/legacy", IdempotencyMiddleware(legacy, store=MemoryStore())))
    app.add_middleware(TryMountedFirst)
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    answer = await client.get("/legacy/items")
    assert (answer.status_code, answer.json()) == (200, {"items": 1})


def login_required(
    endpoint: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A decorator that answers an anonymous request with a redirect to the login page, as
    Starlette's ``@requires(..., redirect=...)`` does, without running the endpoint."""

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        if "x-user" not in request.headers:
            return RedirectResponse("/login", status_code=303)
        return await endpoint(request)

    return wrapper


async def test_an_answer_from_before_the_endpoint_frees_the_key() -> None:
    """A decorator above ``@idempotent`` redirected an anonymous request to the login page:
    the endpoint never ran, so the retry after the login runs it rather than get the
    redirect again."""

    @login_required
    @idempotent()
    async def pay(request: Request) -> Response:
        runs["logged-in pay"] += 1
        return JSONResponse({}, status_code=201)

    app = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
    client = make_client(IdempotencyMiddleware(app, store=MemoryStore()))
    before, headers = runs["logged-in pay"], key()
    anonymous = await client.post("/payments", json={}, headers=headers)
    logged_in = await client.post("/payments", json={}, headers={**headers, "X-User": "ann"})
    assert (anonymous.status_code, logged_in.status_code) == (303, 201)
    assert "x-idempotent-replay" not in logged_in.headers
    assert runs["logged-in pay"] == before + 1


async def test_the_endpoint_finds_its_guard_when_the_server_offers_pathsend() -> None:
    """A server extension the middleware cannot capture is kept from the app on a copy of the
    scope: the endpoint still reports its start there, so its own 401 is its outcome."""

    @idempotent()
    async def denied(request: Request) -> Response:
        runs["denied"] += 1
        return JSONResponse({"run": runs["denied"]}, status_code=401)

    app = Starlette(routes=[Route("/denied", denied, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

    async def server(scope: Scope, receive: Receive, send: Send) -> None:
        await app({**scope, "extensions": {"http.response.pathsend": {}}}, receive, send)

    client, headers, before = make_client(server), key(), runs["denied"]
    answers = [await client.post("/denied", headers=headers) for _ in "12"]
    assert [answer.status_code for answer in answers] == [401, 401]
    assert answers[1].headers.get("x-idempotent-replay") == "true"  # stored: the handler ran
    assert runs["denied"] == before + 1


async def test_a_wraps_decorator_passes_on_the_options_of_idempotent() -> None:
    app = stacked_fastapi()
    store = MemoryStore()
    app.add_middleware(IdempotencyMiddleware, store=store)
    await make_client(app).post("/payments", json={"amount": 1}, headers=key())
    (record,) = [await store.get(k) for k in store.records()]
    assert record is not None
    assert record.expires_at - record.created_at == pytest.approx(48 * 3600, abs=5)


async def test_the_endpoint_signature_is_left_as_written() -> None:
    async def pay(payment: Payment) -> dict[str, int]:
        return {}

    wrapper = idempotent()(pay)
    assert "__signature__" not in vars(wrapper)
    assert inspect.signature(wrapper) == inspect.signature(pay)


async def test_the_guard_leaves_nothing_in_the_context_after_the_request() -> None:
    from starlette_idempotency._endpoint import GUARDED_SCOPE

    app = stacked_fastapi()
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    await client.post("/payments", json={"amount": 1}, headers=key())
    assert GUARDED_SCOPE.get(None) is None
    pay = next(r.endpoint for r in app.routes if isinstance(r, APIRoute) and r.path == "/payments")
    assert await pay(Payment(amount=1)) is not None  # a direct call, with no guard: it runs


async def test_a_refusal_names_the_endpoint_refused_and_the_one_guarded() -> None:
    @idempotent()
    async def first(request: Request) -> Response:
        return Response(status_code=201)

    @idempotent()
    async def second(request: Request) -> Response:
        return Response(status_code=201)

    app = Starlette(
        routes=[
            Route("/charges", first, methods=["POST"]),
            Route("/v1/charges", second, methods=["POST"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
            Middleware(Rewriting),  # inside: sends /v1/charges to /charges
        ],
    )
    message = await refusal(app, "/v1/charges")
    assert "@idempotent tests.core.test_wiring.test_a_refusal" in message
    assert ".<locals>.first was not run for POST /charges" in message
    assert "guarded the request as one to tests.core.test_wiring." in message
    assert ".<locals>.second," in message


async def test_a_refusal_tells_two_endpoints_of_one_name_apart() -> None:
    def handler() -> Any:
        @idempotent()
        async def orders(request: Request) -> Response:
            return Response(status_code=201)

        return orders

    app = Starlette(
        routes=[
            Route("/charges", handler(), methods=["POST"]),
            Route("/v1/charges", handler(), methods=["POST"]),
        ],
        middleware=[
            Middleware(IdempotencyMiddleware, store=MemoryStore()),
            Middleware(Rewriting),
        ],
    )
    assert f"(defined at {__file__}:" in await refusal(app, "/v1/charges")


# -- apps mounted whole under protect_all -----------------------------------------------------


async def graphql(scope: Scope, receive: Receive, send: Send) -> None:
    """A sub-app with no router to look into (as GraphQL servers are mounted)."""
    request = Request(scope, receive)
    runs["graphql"] += 1
    body = await request.body()
    response = JSONResponse({"run": runs["graphql"], "query": body.decode()}, status_code=201)
    await response(scope, receive, send)


async def test_protect_all_guards_an_app_mounted_whole_with_the_mount_as_template() -> None:
    store = MemoryStore()
    app = Starlette(routes=[Mount("/graphql", app=graphql)])
    app.add_middleware(IdempotencyMiddleware, store=store, protect_all=True)
    client = make_client(app)
    await assert_guarded(client, "/graphql/", "graphql", content=b"{ me }")
    await assert_guarded(client, "/graphql/batch", "graphql", content=b"{ me }")
    assert {key.split(":")[2] for key in store.records()} == {"/graphql"}
    assert (await client.get("/graphql/")).status_code == 201  # GET is not guarded


async def test_without_protect_all_an_app_mounted_whole_passes_through() -> None:
    app = Starlette(routes=[Mount("/graphql", app=graphql)])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    before = runs["graphql"]
    for _ in range(2):
        answer = await client.post("/graphql/", headers={"Idempotency-Key": "k"})
        assert answer.status_code == 201
    assert runs["graphql"] == before + 2


async def test_a_decorated_endpoint_in_an_app_the_guard_cannot_see_into_is_refused() -> None:
    inner = charges_app()

    async def opaque(scope: Scope, receive: Receive, send: Send) -> None:
        await inner(scope, receive, send)  # no .app, no .routes: nothing to follow

    for protect_all in (False, True):
        app = Starlette(routes=[Mount("/sub", app=opaque)])
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), protect_all=protect_all)
        assert "was not run for POST /sub/charges" in await refusal(app, "/sub/charges")


# -- requests the app tells apart never share a record -----------------------------------------


def tenant_orders(request: Request) -> Response:
    runs[request.path_params["tenant"]] += 1
    user = request.headers["x-user"]
    return JSONResponse({"tenant": request.path_params["tenant"], "user": user}, status_code=201)


async def test_host_routes_and_tenants_keep_records_apart() -> None:
    store = MemoryStore()
    app = Starlette(
        routes=[
            Host(
                "api.example", Router([Route("/op", idempotent()(tenant_orders), methods=["POST"])])
            ),
            Host(
                "{tenant}.shop.example",
                Router([Route("/op", idempotent()(tenant_orders), methods=["POST"])]),
            ),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=store, key_scope=lambda r: r.headers["x-user"])
    client = make_client(app)
    headers = {"Idempotency-Key": "one-key", "x-user": "1"}
    answers: dict[str, Any] = {}
    for tenant in ("acme", "globex", "acme"):
        response = await client.post(f"http://{tenant}.shop.example/op", json={}, headers=headers)
        answers.setdefault(tenant, response.json())
        assert response.json() == answers[tenant] == {"tenant": tenant, "user": "1"}
    assert (runs["acme"], runs["globex"]) == (1, 1)
    assert sorted(k.split(":")[2] for k in store.records()) == [
        "acme.shop.example/op",
        "globex.shop.example/op",
    ]


async def test_two_hosts_with_one_path_keep_records_apart() -> None:
    async def api(request: Request) -> Response:
        runs["api"] += 1
        return JSONResponse({"host": "api"}, status_code=201)

    async def admin(request: Request) -> Response:
        runs["admin"] += 1
        return JSONResponse({"host": "admin"}, status_code=201)

    app = Starlette(
        routes=[
            Host("api.example", Router([Route("/op", idempotent()(api), methods=["POST"])])),
            Host("admin.example", Router([Route("/op", idempotent()(admin), methods=["POST"])])),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=lambda r: "t")
    client = make_client(app)
    headers = {"Idempotency-Key": "k"}
    first = await client.post("http://api.example/op", json={"a": 1}, headers=headers)
    other = await client.post("http://admin.example/op", json={"a": 1}, headers=headers)
    assert first.json() == {"host": "api"}
    assert other.json() == {"host": "admin"}
    assert "x-idempotent-replay" not in other.headers


async def test_a_record_an_older_version_stored_is_still_found_after_an_upgrade() -> None:
    """A rolling deploy: routes under no Host keep their storage key, so a retry that lands
    on an upgraded pod is replayed, not run again (on_fingerprint_change="replay")."""
    store = MemoryStore()
    stored_by_old_pod = IdempotencyRecord(
        key="k",
        status=RecordStatus.COMPLETED,
        request_fingerprint="sha256:" + "0" * 64,
        owner_token="old-pod",
        created_at=0,
        expires_at=4e9,
        fingerprint_version="2.raw.1",
        response=StoredResponse(201, (("content-type", "application/json"),), b'{"run":1}'),
    )
    old_key = storage_key("", "POST", "/charges", "k")  # the key the last release built
    assert (await store.try_acquire(old_key, stored_by_old_pod, 30)).acquired
    app = charges_app(Middleware(IdempotencyMiddleware, store=store))
    before = runs["partial"]
    retry = await make_client(app).post("/charges", headers={"Idempotency-Key": "k"})
    assert retry.headers.get("x-idempotent-replay") == "true"
    assert retry.json() == {"run": 1}
    assert runs["partial"] == before


def events_app(store: MemoryStore, name: str, path: str = "/v1/events", **options: Any) -> Any:
    """``POST path`` of a service, its handler named ``name`` (as a rename, a move or another
    launch mode names it), on ``store``."""

    async def events(request: Request) -> Response:
        runs[name] += 1
        return JSONResponse({"handler": name, "run": runs[name]}, status_code=201)

    events.__module__, _, events.__qualname__ = name.rpartition(":")
    app = Starlette(routes=[Route(path, idempotent(**options)(events), methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store)
    return make_client(app)


@pytest.mark.parametrize(
    "renamed",
    ["app.payments:create_payment", "app.billing:pay", "__main__:pay"],
    ids=["rename", "move", "launch mode"],
)
async def test_a_retry_across_a_renamed_or_moved_handler_is_replayed(renamed: str) -> None:
    """Two versions of one app on one store (a deploy in between)."""
    store = MemoryStore()
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = await events_app(store, "app.payments:pay").post("/v1/events", json={}, headers=headers)
    retry = await events_app(store, renamed).post("/v1/events", json={}, headers=headers)
    assert retry.headers.get("x-idempotent-replay") == "true", retry.text
    assert retry.json() == first.json()
    assert runs[renamed] == 0


async def test_an_operation_keeps_its_records_across_a_new_template() -> None:
    """``operation=`` names the records, not the route template: a version that serves the
    same path through another template replays the earlier one's answers."""
    store = MemoryStore()
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    one = events_app(store, "v1:events", "/v1/events", operation="events.receive")
    two = events_app(store, "v2:events", "/v1/{kind}", operation="events.receive")
    first = await one.post("/v1/events", json={}, headers=headers)
    retry = await two.post("/v1/events", json={}, headers=headers)
    assert retry.headers.get("x-idempotent-replay") == "true", retry.text
    assert retry.json() == first.json()
    assert {key.split(":")[2] for key in store.records()} == {"events.receive"}
    other_body = await two.post("/v1/events", json={"e": 1}, headers=headers)
    assert other_body.status_code == 422


async def test_two_services_naming_their_operations_never_share_a_record() -> None:
    """Two services on one store, both serving ``POST /v1/events``: a key a gateway sends to
    both is run by each."""
    store = MemoryStore()
    ledger = events_app(store, "ledger:events", operation="ledger.events")
    notifications = events_app(store, "notifications:events", operation="notifications.events")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    for _ in range(2):
        answers = [
            await c.post("/v1/events", json={}, headers=headers) for c in (ledger, notifications)
        ]
        assert [a.json()["handler"] for a in answers] == ["ledger:events", "notifications:events"]
        assert [a.json()["run"] for a in answers] == [runs["ledger:events"]] * 2


# -- bodies and headers -----------------------------------------------------------------------


async def test_a_content_length_too_long_to_be_a_number_is_a_400() -> None:
    client = make_client(
        IdempotencyMiddleware(Starlette(routes=[Route("/orders", Orders)]), store=MemoryStore())
    )
    for length in ("9" * 5000, "0" * 19 + "1"):
        answer = await client.post("/orders", headers={**key(), "content-length": length})
        assert answer.status_code == 400, answer.text
        assert answer.headers["cache-control"] == "no-store"


async def test_the_middlewares_own_answers_are_never_cached() -> None:
    app = Starlette(routes=[Route("/orders", Orders)])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), max_body_bytes=10)
    client = make_client(app)
    answers = [
        await client.post("/orders"),  # 400: no key
        await client.post("/orders", content=b"x" * 11, headers=key()),  # 413
    ]
    headers = key()
    await client.post("/orders", json={"a": 1}, headers=headers)
    answers.append(await client.post("/orders", json={"a": 2}, headers=headers))  # 422
    assert [answer.status_code for answer in answers] == [400, 413, 422]
    assert all(answer.headers["cache-control"] == "no-store" for answer in answers)


class BareRoute(BaseRoute):
    """A custom route that sets no ``endpoint`` in the scope and hides its endpoint."""

    def __init__(self, path: str, call: Any) -> None:
        self.path = path
        self._call = call

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return (Match.FULL, {}) if scope.get("path") == self.path else (Match.NONE, {})

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._call(Request(scope, receive))
        await response(scope, receive, send)


async def test_a_custom_route_the_guard_cannot_read_is_refused() -> None:
    app = Starlette(routes=[BareRoute("/charges", functools.partial(charge, currency="EUR"))])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    before = runs["partial"]
    assert "found no guarded route" in await refusal(app, "/charges")
    assert runs["partial"] == before
