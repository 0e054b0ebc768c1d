"""Error bodies: every error carries a stable ``code`` in every ``error_format``: ``"json"``
keeps ``{"error": "<message>"}`` and adds ``code``; ``"stripe"`` is ``{"error": {"type", "code",
"message"}}``; a callable builds its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import ConfigurationError, IdempotencyMiddleware, MemoryStore, idempotent
from starlette_idempotency._kept_response import ResponseEncryption
from starlette_idempotency._responses import ErrorFormat, IdempotencyProblem, Problem
from starlette_idempotency.stores import IdempotencyRecord
from starlette_idempotency.stores.base import AcquireResult
from tests.support.guarded import make_client

CODES = {
    Problem.MISSING_KEY: (400, "idempotency_key_missing"),
    Problem.INVALID_KEY: (400, "idempotency_key_invalid"),
    Problem.INVALID_REQUEST: (400, "request_malformed"),
    Problem.BODY_TOO_LARGE: (413, "request_body_too_large"),
    Problem.IN_PROGRESS: (409, "idempotency_key_in_use"),
    Problem.ALREADY_PROCESSED: (409, "idempotency_key_already_processed"),
    Problem.MISMATCH: (422, "idempotency_key_reused"),
    Problem.STORE_UNAVAILABLE: (503, "idempotency_store_unavailable"),
    Problem.RESPONSE_UNREADABLE: (503, "idempotency_response_unreadable"),
}


def test_every_error_has_a_stable_code() -> None:
    # Clients switch on these: changing one is a breaking change.
    assert {problem: (problem.status, problem.code) for problem in Problem} == CODES


PROBLEMS = pytest.mark.parametrize("problem", list(Problem), ids=lambda problem: problem.name)


#: A 422 names the request that first used the key (``/pay`` answered it 201, no Location).
FIRST_REQUEST = {"status": 201}


def extra(problem: Problem) -> list[str]:
    """The members beside the usual ones: ``first_request`` on the 422 alone."""
    return ["first_request"] if problem is Problem.MISMATCH else []


def checked_body(response: httpx.Response, problem: Problem, content_type: str) -> Any:
    """``response``'s JSON body, once its status and content type are checked."""
    assert response.status_code == problem.status
    assert response.headers["content-type"] == content_type
    return response.json()


class DownForOneKey(MemoryStore):
    """A MemoryStore that is unreachable for the key ``down``."""

    async def try_acquire(
        self, key: str, pending: IdempotencyRecord, lock_ttl: float, *, recover: bool = True
    ) -> AcquireResult:
        if pending.key == "down":
            raise ConnectionError("store unreachable")
        return await super().try_acquire(key, pending, lock_ttl, recover=recover)


class App:
    """Two guarded routes (``/pay`` can be held, ``/once`` answers replays with 409) and one
    request per problem."""

    def __init__(self, error_format: ErrorFormat, **options: Any) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()

        @idempotent()
        async def pay(request: Request) -> Response:
            if request.headers.get("x-hold"):
                self.entered.set()
                await self.release.wait()
            return JSONResponse({"paid": True}, status_code=201)

        @idempotent(replay="reject")
        async def once(request: Request) -> Response:
            return JSONResponse({"paid": True}, status_code=201)

        app = Starlette(
            routes=[Route("/pay", pay, methods=["POST"]), Route("/once", once, methods=["POST"])]
        )
        store = DownForOneKey()
        middleware = IdempotencyMiddleware(
            app, store=store, max_body_bytes=100, error_format=error_format, **options
        )
        self.client = make_client(middleware)
        # Another deploy, which sealed its responses with a key this one does not have.
        sealing = ResponseEncryption({"retired": ResponseEncryption.generate_key()})
        self.sealing_client = make_client(
            IdempotencyMiddleware(app, store=store, encryption=sealing)
        )

    async def post(
        self, path: str = "/pay", key: str | None = "k", **kwargs: Any
    ) -> httpx.Response:
        headers = {**kwargs.pop("headers", {}), **({} if key is None else {"Idempotency-Key": key})}
        return await self.client.post(path, headers=headers, **kwargs)

    async def answer(self, problem: Problem) -> httpx.Response:
        if problem is Problem.IN_PROGRESS:
            first = asyncio.create_task(self.post(json={}, headers={"x-hold": "1"}))
            async with asyncio.timeout(5):
                await self.entered.wait()
            response = await self.post(json={})
            self.release.set()
            await first
            return response
        if problem is Problem.ALREADY_PROCESSED:
            await self.post("/once", json={})
            return await self.post("/once", json={})
        if problem is Problem.RESPONSE_UNREADABLE:
            await self.sealing_client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
            return await self.post(json={})
        if problem is Problem.MISMATCH:
            await self.post(json={"amount": 1})
            return await self.post(json={"amount": 2})
        requests: dict[Problem, Callable[[], Awaitable[httpx.Response]]] = {
            Problem.MISSING_KEY: lambda: self.post(key=None, json={}),
            Problem.INVALID_KEY: lambda: self.post(key="has space", json={}),
            Problem.INVALID_REQUEST: lambda: self.post(
                content=b"{}", headers={"content-length": "2, 2"}
            ),
            Problem.BODY_TOO_LARGE: lambda: self.post(content=b"x" * 101),
            Problem.STORE_UNAVAILABLE: lambda: self.post(key="down", json={}),
        }
        return await requests[problem]()


@PROBLEMS
async def test_json_format_keeps_the_message_and_adds_the_code(problem: Problem) -> None:
    body = checked_body(await App("json").answer(problem), problem, "application/json")
    assert list(body) == ["error", "code", *extra(problem)]
    assert isinstance(body["error"], str)
    assert body["error"]
    assert body["code"] == problem.code
    assert body.get("first_request", FIRST_REQUEST) == FIRST_REQUEST


@PROBLEMS
async def test_stripe_format(problem: Problem) -> None:
    body = checked_body(await App("stripe").answer(problem), problem, "application/json")
    assert list(body) == ["error"]
    assert list(body["error"]) == ["type", "code", "message", *extra(problem)]
    assert body["error"].get("first_request", FIRST_REQUEST) == FIRST_REQUEST
    assert body["error"]["code"] == problem.code
    assert body["error"]["type"] == problem.error_type
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]


def test_json_error_types_use_stripes_vocabulary() -> None:
    kinds = {problem.error_type for problem in Problem}
    assert kinds == {"invalid_request_error", "idempotency_error", "api_error"}
    assert Problem.MISMATCH.error_type == "idempotency_error"
    assert Problem.STORE_UNAVAILABLE.error_type == "api_error"


@PROBLEMS
async def test_problem_format_carries_the_code(problem: Problem) -> None:
    body = checked_body(await App("problem").answer(problem), problem, "application/problem+json")
    assert list(body) == ["type", "title", "status", "detail", "code", *extra(problem)]
    assert (body["status"], body["code"]) == (problem.status, problem.code)
    assert body.get("first_request", FIRST_REQUEST) == FIRST_REQUEST


# The type URI of each problem below problem_type: clients and gateways route on these.
TYPE_SEGMENTS = {
    Problem.MISSING_KEY: "key-missing",
    Problem.INVALID_KEY: "key-invalid",
    Problem.INVALID_REQUEST: "request-malformed",
    Problem.BODY_TOO_LARGE: "request-body-too-large",
    Problem.IN_PROGRESS: "key-in-use",
    Problem.ALREADY_PROCESSED: "key-already-processed",
    Problem.MISMATCH: "key-reused",
    Problem.STORE_UNAVAILABLE: "store-unavailable",
    Problem.RESPONSE_UNREADABLE: "response-unreadable",
}


@PROBLEMS
@pytest.mark.parametrize(
    "base",
    ["https://errors.example.com/idempotency", "https://errors.example.com/idempotency/"],
    ids=["base", "trailing-slash"],
)
async def test_each_problem_has_its_own_type_below_problem_type(
    problem: Problem, base: str
) -> None:
    app = App("problem", problem_type=base)
    body = checked_body(await app.answer(problem), problem, "application/problem+json")
    assert body["type"] == f"https://errors.example.com/idempotency/{TYPE_SEGMENTS[problem]}"


@PROBLEMS
async def test_about_blank_stays_the_type_of_every_problem(problem: Problem) -> None:
    body = checked_body(await App("problem").answer(problem), problem, "application/problem+json")
    assert body["type"] == "about:blank"


@PROBLEMS
async def test_a_callable_builds_the_body_from_the_problem(problem: Problem) -> None:
    seen: list[IdempotencyProblem] = []

    def envelope(problem: IdempotencyProblem) -> dict[str, Any]:
        seen.append(problem)
        return {"ok": False, "reason": problem.code, "text": problem.detail}

    app = App(envelope)
    seen.clear()  # the call made at startup to check the callable
    response = await app.answer(problem)
    body = checked_body(response, problem, "application/json")
    got = seen[-1]
    assert (got.status, got.code) == (problem.status, problem.code)
    assert got.title == problem.title.format(header="Idempotency-Key")
    first = (201, None) if problem is Problem.MISMATCH else (None, None)
    assert (got.first_status, got.first_location) == first
    assert body == {"ok": False, "reason": problem.code, "text": got.detail}
    if problem in (Problem.IN_PROGRESS, Problem.STORE_UNAVAILABLE):
        assert response.headers["retry-after"] == "1"


def _raises(problem: IdempotencyProblem) -> dict[str, Any]:
    raise KeyError("no such template")


@pytest.mark.parametrize(
    "error_format",
    [
        "xml",
        _raises,
        lambda problem: ["not", "an", "object"],
        lambda problem: {"when": object()},
    ],
    ids=["unknown-name", "raises", "not-a-dict", "not-serialisable"],
)
def test_a_bad_error_format_fails_at_startup(error_format: Any) -> None:
    with pytest.raises(ConfigurationError, match="error_format"):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), error_format=error_format)


async def test_json_answers_stripes_sdks_in_the_shape_they_parse() -> None:
    app = App("json")
    stripe_sdk = {"X-Stripe-Client-User-Agent": '{"bindings_version": "16.1.0"}'}
    from_stripe = await app.post(key="has space", json={}, headers=stripe_sdk)
    assert from_stripe.json()["error"]["code"] == "idempotency_key_invalid"
    from_anyone = await app.post(key="has space", json={})
    assert isinstance(from_anyone.json()["error"], str)
    assert from_anyone.json()["code"] == "idempotency_key_invalid"
