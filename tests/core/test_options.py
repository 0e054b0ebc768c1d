from __future__ import annotations

import functools
import re
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware.gzip import GZipMiddleware
from starlette.testclient import TestClient

from starlette_idempotency import ConfigurationError, IdempotencyMiddleware, MemoryStore, idempotent


@pytest.mark.parametrize(
    "options",
    [
        {"ttl_hours": 0},
        {"lock_ttl_seconds": -1},
        {"on_store_error": "maybe"},
        {"exclude_fields": "amount"},
    ],
)
def test_invalid_decorator_options_fail_at_import_time(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        idempotent(**options)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "options",
    [
        {"max_key_length": 0},
        {"store_timeout_seconds": 0},
        {"lock_ttl_seconds": 0},
        {"error_format": "xml"},
    ],
)
def test_invalid_middleware_options(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"."):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)  # type: ignore[arg-type]


def test_fractional_durations_are_accepted() -> None:
    idempotent(ttl_hours=0.5, lock_ttl_seconds=0.25)


def test_record_offers_the_designs_flat_response_fields() -> None:
    from starlette_idempotency import StoredResponse
    from starlette_idempotency.stores import IdempotencyRecord, RecordStatus

    pending = IdempotencyRecord("k", RecordStatus.IN_PROGRESS, "sha256:x", "owner", 1.0, 2.0)
    assert pending.response_status_code is None
    assert pending.response_body is None
    done = pending.finished(
        RecordStatus.COMPLETED,
        StoredResponse(201, (("content-type", "application/json"),), b"{}", "application/json"),
        expires_at=3.0,
    )
    assert done.status == "Completed"
    assert done.response_status_code == 201
    assert done.response_body == b"{}"
    assert done.response_headers == (("content-type", "application/json"),)
    assert done.response_content_type == "application/json"


@pytest.mark.parametrize(
    ("store", "message"),
    [
        (MemoryStore, "not the class MemoryStore: pass MemoryStore(...)"),
        ("redis://localhost:6379/0", "RedisStore.from_url('redis://localhost:6379/0')"),
        (object(), "must implement the IdempotencyStore protocol"),
        ({"a": 1}, "dict lacks try_acquire, finish, save_progress, release, renew"),
    ],
)
def test_what_is_not_a_store_is_refused_when_the_middleware_is_built(
    store: object, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        IdempotencyMiddleware(Starlette(), store=store)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl_hours": "48"}, "ttl_hours must be a positive number of hours, not '48'"),
        ({"lock_ttl_seconds": True}, "lock_ttl_seconds must be a positive number of seconds"),
        ({"required": "yes"}, "required must be True or False, not 'yes'"),
        ({"max_response_bytes": 1.5}, "max_response_bytes must be a whole number of bytes"),
        ({"replay": "full"}, "replay must be one of 'response', 'reject', not 'full'"),
        (
            {"ttl_hours": 0.01, "lock_ttl_seconds": 60},
            "lock_ttl_seconds (60 s) must not exceed ttl_hours (0.01 h = 36 s)",
        ),
    ],
)
def test_wrong_option_values_name_the_option_and_what_it_accepts(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        idempotent(**options)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_key_length": "10"}, "max_key_length must be a whole number, not '10'"),
        ({"max_key_length": 10.5}, "max_key_length must be a whole number, not 10.5"),
        ({"max_key_length": 0}, "max_key_length must be at least 1, not 0"),
        ({"max_waiters": "x"}, "max_waiters must be a whole number, not 'x'"),
        ({"max_waiters": 0}, "max_waiters must be at least 1, not 0"),
        ({"max_body_bytes": "1"}, "max_body_bytes must be a whole number of bytes, not '1'"),
        ({"max_body_bytes": -1}, "max_body_bytes must not be negative, not -1"),
        ({"store_timeout_seconds": "1"}, "store_timeout_seconds must be a positive number of"),
        ({"store_timeout_seconds": 0}, "store_timeout_seconds must be a positive number of"),
        ({"protect_all": "yes"}, "protect_all must be True or False, not 'yes'"),
        ({"tracing": 1}, "tracing must be True or False, not 1"),
        ({"log_keys": "md5"}, "log_keys must be one of 'raw', 'hashed', not 'md5'"),
        ({"check_store": "loud"}, "check_store must be one of 'warn', 'fail', 'off'"),
        ({"header_name": 5}, "header_name must be an HTTP header name such as"),
        ({"header_name": ""}, "header_name must be an HTTP header name such as"),
        ({"header_name": "Idempotency Key"}, "header_name must be an HTTP header name such as"),
        ({"replay_header_name": "Idempotent Replayed"}, "replay_header_name must be an HTTP"),
        ({"replay_header_name": None}, "replay_header_name must be an HTTP header name such as"),
        ({"methods": "POST"}, "methods must be a list of HTTP methods such as ['POST', 'PATCH']"),
        ({"methods": ["POST", ""]}, "methods must be a list of HTTP methods such as"),
        ({"problem_type": 3}, "problem_type must be a URI string, not 3"),
        ({"ttl_hours": float("inf")}, "ttl_hours must be a positive number of hours, not inf"),
        ({"wait_timeout_seconds": float("nan")}, "wait_timeout_seconds must be a positive"),
    ],
)
def test_wrong_middleware_option_values_name_the_option(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)  # type: ignore[arg-type]


def test_a_route_retention_shorter_than_the_default_lock_is_checked_with_the_middlewares() -> None:
    """The decorator cannot know the middleware's lock yet: it checks the pair at startup."""
    options = idempotent(ttl_hours=0.005)  # 18 s: shorter than the default 30 s lock
    assert callable(options)


def test_unknown_options_get_a_did_you_mean() -> None:
    with pytest.raises(ConfigurationError, match=r"'ttl_hour' \(did you mean 'ttl_hours'\?\)"):
        idempotent(ttl_hour=48)  # type: ignore[call-overload]
    with pytest.raises(
        ConfigurationError,
        match=r"for IdempotencyMiddleware: 'header' \(did you mean 'header_name'\?\)",
    ):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), header="X-Key")  # type: ignore[call-arg]


def test_a_positional_option_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="takes its options by name"):
        idempotent(48)  # type: ignore[call-overload]


@pytest.mark.parametrize("between", [False, True], ids=["stacked", "a wraps decorator between"])
def test_idempotent_applied_twice_is_refused_where_it_is_written(between: bool) -> None:
    """It was accepted, then failed every request with a message about rewritten paths."""

    def passing(func: Any) -> Any:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            return await func(*args, **kwargs)

        return wrapper

    async def pay() -> None: ...

    once = idempotent(ttl_hours=1)(pay)
    with pytest.raises(ConfigurationError, match=r"applied twice to .*pay: keep one"):
        idempotent(lock_ttl_seconds=5)(passing(once) if between else once)


async def test_bare_decorator_takes_the_middlewares_options() -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    runs: list[int] = []

    @idempotent
    async def pay(request: Request) -> Response:
        runs.append(1)
        return JSONResponse({"n": len(runs)})

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), ttl_hours=48)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await client.post("/pay", headers={"Idempotency-Key": "k"})
        replay = await client.post("/pay", headers={"Idempotency-Key": "k"})
        missing = await client.post("/pay")
    assert first.json() == replay.json() == {"n": 1}
    assert replay.headers["x-idempotent-replay"] == "true"
    assert missing.status_code == 400


def test_an_option_given_by_position_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"takes its options by name \(store=\.\.\."):
        IdempotencyMiddleware(Starlette(), MemoryStore())  # type: ignore[call-arg]


def misconfigured_app(**options: object) -> Starlette:
    """An app whose stack Starlette builds with wrong middleware options, a layer between."""
    app = Starlette()
    app.add_middleware(GZipMiddleware)  # innermost: the middleware finds the stack through it
    app.add_middleware(IdempotencyMiddleware, **options)  # type: ignore[arg-type]
    app.add_middleware(GZipMiddleware)
    return app


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "IdempotencyMiddleware needs a store"),
        ({"store": MemoryStore(), "ttl_hour": 1}, "did you mean 'ttl_hours'"),
    ],
)
def test_built_into_an_apps_stack_wrong_options_refuse_the_startup(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message), TestClient(misconfigured_app(**options)):
        pass


async def test_built_into_an_apps_stack_wrong_options_refuse_every_request() -> None:
    """Where the server runs no lifespan, each request raises the refusal."""
    transport = httpx.ASGITransport(app=misconfigured_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for _ in range(2):
            with pytest.raises(ConfigurationError, match="needs a store"):
                await client.get("/")
