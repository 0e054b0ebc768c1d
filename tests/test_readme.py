"""Every Python block of README.md and of the documentation pages (docs/) runs here, and the
curl transcripts after a block (the quick starts', the tutorials') are replayed against the app
it defines, so neither the README nor the docs can rot. "The README" below means any of these
pages; messages name the page and line.

How a block runs (the rules of reading are in ``tests/readme_blocks.py``):

- Each Python block is compiled as the user would run it (top-level ``await`` allowed, none of
  this module's ``__future__`` flags) into a fresh module, with README.md's line numbers in
  tracebacks. Literals that name the README's servers are swapped for the test servers, each
  swap listed in ``SUBSTITUTIONS`` with its reason.
- A block that uses names defined elsewhere (a handler for "your" app) carries
  ``<!-- readme-test: context=NAME -->``: ``CONTEXTS[NAME]`` gives it those names and then
  checks what the README says the block does. ``<!-- readme-test: skip (reason) -->`` skips a
  block, reported with its reason. A block with neither runs as it is, so a block the test
  cannot run fails until it gets a marker.
- The transcripts after a Python block (``$ curl ...`` and what it prints) are replayed, in
  order, through httpx against the ``app`` the block defines, in-process, with its lifespan
  started first; each response must show the status, headers and body the README shows.
- Every store the block made (in its names or given to its app's middleware) is closed after
  it; Redis keys live under a prefix of the test's own and PostgreSQL rows in a table of its own.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import logging
import re
import sys
import traceback
import types
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from starlette_idempotency import (
    IdempotencyMiddleware,
    IdempotencyStore,
    KeySource,
    MemoryStore,
    ResponseEncryption,
    idempotent,
)
from starlette_idempotency.testing._isolation import delete_prefixed, unique_prefix
from tests.support.readme_blocks import (
    Block,
    Example,
    Marker,
    ReadmeError,
    ShownResponse,
    parse_curl,
    read_blocks,
    read_examples,
    read_transcript,
)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NOT_RUN = {
    ROOT / "docs" / "how-to" / "testing.md": "its blocks are tests/testing/guide_app.py and "
    "tests/testing/test_guide.py, which run in the suite (tests/testing/test_docs.py keeps the "
    "page showing them verbatim)",
}
"""Documentation pages whose Python blocks are not run here, each with the reason."""
PAGES = (README, *sorted(set((ROOT / "docs").rglob("*.md")) - set(NOT_RUN)))


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def on_page(page: Path, error: ReadmeError) -> ReadmeError:
    """``error`` of ``tests/readme_blocks.py`` (which says README.md) naming ``page`` instead."""
    return ReadmeError(str(error).replace("README.md:", f"{page_name(page)}:"))


def read_page(page: Path) -> list[Block]:
    try:
        return read_blocks(page.read_text(encoding="utf-8"))
    except ReadmeError as exc:
        raise on_page(page, exc) from None


@dataclass(frozen=True)
class PageExample:
    """A Python block of ``page`` and the transcripts replayed against its app."""

    page: Path
    example: Example

    @property
    def name(self) -> str:
        return page_name(self.page)


def replayable(page: Path, block: Block) -> bool:
    """Whether ``read_examples`` should see ``block``: in the docs, a shell session that runs
    no curl (``$ starlette-idempotency doctor ...``, ``$ pip install ...``) shows a command's
    output, and is not a transcript to replay. The README has none: there every session is one.
    """
    if page == README or block.is_python or not block.is_transcript:
        return True
    return any(line.startswith("$ curl") for line in block.source.splitlines())


def read_page_examples(page: Path) -> list[PageExample]:
    try:
        examples = read_examples([block for block in read_page(page) if replayable(page, block)])
    except ReadmeError as exc:
        raise on_page(page, exc) from None
    return [PageExample(page, example) for example in examples]


EXAMPLES = [example for page in PAGES for example in read_page_examples(page)]


@dataclass
class Run:
    """One block's run: fixtures on demand, monkeypatch, and a stack that closes what it
    opened."""

    request: pytest.FixtureRequest
    monkeypatch: pytest.MonkeyPatch
    stack: AsyncExitStack

    def fixture(self, name: str) -> Any:
        return self.request.getfixturevalue(name)


# --- substitutions -----------------------------------------------------------------------


async def _test_redis(run: Run) -> str:
    url: str = run.fixture("redis_url")
    prefix = unique_prefix()

    async def delete_keys() -> None:
        client = aioredis.from_url(url)
        try:
            await delete_prefixed(client, prefix)
        finally:
            await client.aclose()

    run.stack.push_async_callback(delete_keys)
    return f"{url!r}, key_prefix={prefix!r}"


async def _test_postgres(run: Run) -> str:
    return f"{run.fixture('postgres_dsn')!r}, table={run.fixture('postgres_table')!r}"


async def _test_encryption_key(run: Run) -> str:
    run.monkeypatch.setenv("IDEMPOTENCY_KEY_2026_12", ResponseEncryption.generate_key())
    return _ENCRYPTION_KEY


_ENCRYPTION_KEY = 'os.environ["IDEMPOTENCY_KEY_2026_12"]'


@dataclass(frozen=True)
class Substitution:
    literal: str
    why: str
    replacement: Callable[[Run], Awaitable[str]]


SUBSTITUTIONS = (
    Substitution(
        '"redis://localhost:6379/0"',
        "the tests' Redis (REDIS_URL or a server of the run), under a key prefix of the "
        "test's own that is deleted after it",
        _test_redis,
    ),
    Substitution(
        _ENCRYPTION_KEY,
        "unchanged: the environment variable is set to a new key for the block",
        _test_encryption_key,
    ),
    Substitution(
        '"postgresql://app@localhost/app"',
        "the run's own PostgreSQL database (the pytest plugin's postgres_dsn), in a table of "
        "the test's own",
        _test_postgres,
    ),
)


async def substituted(block: Block, run: Run) -> str:
    source = block.source
    for substitution in SUBSTITUTIONS:
        if substitution.literal in source:
            replacement = await substitution.replacement(run)
            assert "\n" not in replacement  # README line numbers stay right
            source = source.replace(substitution.literal, replacement)
    return source


# --- running a block -----------------------------------------------------------------------


async def execute(page: Path, block: Block, run: Run, names: dict[str, Any]) -> dict[str, Any]:
    """Run ``block`` of ``page`` as a module of its own holding ``names``; return the module's
    names."""
    slug = re.sub(r"\W", "_", page_name(page).removesuffix(".md"))
    module = types.ModuleType(f"{slug}_line_{block.line}")
    module.__file__ = str(page)
    module.__dict__.update(names)
    run.monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    run.stack.push_async_callback(close_stores, namespace)
    source = "\n" * block.line + await substituted(block, run)  # README line numbers
    code = compile(
        source,
        block_filename(page),
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
        dont_inherit=True,
    )
    try:
        result = eval(code, namespace)
        if inspect.isawaitable(result):
            await result
    except Exception as exc:
        note_readme_line(exc, page)
        raise
    return namespace


def block_filename(page: Path) -> str:
    """The file name of a page's code, ``<README.md>``: not a readable path, so that pytest
    does not print the whole page above a failing line (a module's code has no shorter
    source); the failing line itself is added to the error as a note."""
    return f"<{page_name(page)}>"


def note_readme_line(exc: BaseException, page: Path) -> None:
    """Add to ``exc`` the line of ``page`` where it left the page's code last, if it passed
    through it."""
    frames = traceback.extract_tb(exc.__traceback__)
    numbers = [frame.lineno for frame in frames if frame.filename == block_filename(page)]
    if numbers and numbers[-1] is not None:
        line = page.read_text(encoding="utf-8").splitlines()[numbers[-1] - 1]
        exc.add_note(f"{page_name(page)}:{numbers[-1]}: {line.strip()}")


async def close_stores(namespace: dict[str, Any]) -> None:
    """Close each store the block made: in its names, or given to its app's middleware."""
    found: list[object] = list(namespace.values())
    app = namespace.get("app")
    for middleware in getattr(app, "user_middleware", ()):
        found.extend(middleware.kwargs.values())
    stores = {
        id(value): value
        for value in found
        if isinstance(value, IdempotencyStore) and not isinstance(value, type)
    }
    for store in stores.values():
        await store.aclose()


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run the app's ASGI lifespan around the block (httpx's ASGITransport sends none)."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, inbox.get, outbox.put))

    async def step(name: str) -> None:
        await inbox.put({"type": f"lifespan.{name}"})
        answer = asyncio.ensure_future(outbox.get())
        async with asyncio.timeout(10):
            await asyncio.wait({answer, task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            answer.cancel()
            task.result()  # the app's own error, if it raised one
            raise AssertionError(f"the app returned without answering lifespan.{name}")
        assert answer.result()["type"] == f"lifespan.{name}.complete", answer.result()

    await step("startup")
    try:
        yield
    finally:
        await step("shutdown")
        await task


@asynccontextmanager
async def serve(app: ASGIApp, *, raise_app_exceptions: bool) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client for ``app`` in-process, sending what curl sends by default."""
    async with lifespan(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(
            transport=transport,
            base_url="http://localhost:8000",
            headers={"User-Agent": "curl/8.5.0", "Accept": "*/*"},
        ) as client:
            del client.headers["Accept-Encoding"]  # curl asks for none without --compressed
            yield client


# --- transcripts ---------------------------------------------------------------------------

RFC_9110_REASONS = {
    413: {"Payload Too Large", "Content Too Large"},
    422: {"Unprocessable Entity", "Unprocessable Content"},
}
"""Reason phrases RFC 9110 renamed: a server sends the one its Python knows (3.13 the new one,
earlier Pythons the old one), so either is right whatever Python runs the tests."""


def differences(shown: ShownResponse, response: httpx.Response) -> list[str]:
    problems = []
    if response.status_code != shown.status:
        problems.append(f"status {response.status_code}, the README shows {shown.status}")
    reasons = {HTTPStatus(shown.status).phrase, *RFC_9110_REASONS.get(shown.status, ())}
    if shown.reason and shown.reason not in reasons:
        problems.append(f"reason {shown.reason!r} is not the phrase of {shown.status}")
    for name, value in shown.headers:
        sent = response.headers.get_list(name)
        if value not in sent:
            problems.append(f"header {name}: {sent or 'absent'}, the README shows {value!r}")
    if shown.body is not None and not same_body(shown.body, response.text):
        problems.append(f"body {response.text!r}, the README shows {shown.body!r}")
    return problems


def same_body(shown: str, sent: str) -> bool:
    try:
        return bool(json.loads(shown) == json.loads(sent))
    except ValueError:
        return shown.strip() == sent.strip()


async def replay(page: Path, transcript: Block, client: httpx.AsyncClient) -> None:
    try:
        exchanges = read_transcript(transcript)
    except ReadmeError as exc:
        raise on_page(page, exc) from None
    for exchange in exchanges:
        sent = exchange.request
        where = f"{page_name(page)}:{exchange.line}: $ {exchange.command}"
        try:
            response = await client.request(
                sent.method, sent.url, headers=list(sent.headers), content=sent.body
            )
        except Exception as exc:  # the app raised: a transcript never shows that
            exc.add_note(where)
            note_readme_line(exc, page)
            raise
        problems = differences(exchange.response, response)
        assert not problems, "\n  ".join([where, *problems])


# --- contexts: the names a block uses but does not define, and what it must then do ----------


class Context:
    """``<!-- readme-test: context=NAME -->``: names for the block, then a check of it."""

    async def names(self, run: Run) -> dict[str, Any]:
        return {}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        """What the README says the block does."""


class Payment(BaseModel):
    accountId: str
    amount: str
    currency: str


PAYMENT = {"accountId": "a_1", "amount": "9.99", "currency": "EUR"}


class LosingProvider:
    """A payment provider whose answer to the first charge is lost: the money moves, the
    handler gets an error (the pod died, the connection dropped)."""

    def __init__(self) -> None:
        self.charges: dict[str, dict[str, str]] = {}
        self.calls: list[str] = []  # each charge the handler asked for
        self.lose_next_answer = True

    async def charge(self, body: Payment, *, idempotency_reference: str) -> dict[str, str]:
        self.calls.append(idempotency_reference)
        charge = {"ref": idempotency_reference, "amount": body.amount}
        self.charges.setdefault(idempotency_reference, charge)
        if self.lose_next_answer:
            self.lose_next_answer = False
            raise ConnectionError("the provider's answer was lost")
        return charge

    async def find(self, reference: str) -> dict[str, str] | None:
        return self.charges.get(reference)


class PaymentsContext(Context):
    """The recovery-points handler: a FastAPI app guarded with a MemoryStore, its ``Payment``
    model, and a provider that charges but whose answer is lost the first time. The README:
    a handler that fails after a checkpoint ends its lease at once, and the retry reconciles
    instead of charging again."""

    def __init__(self) -> None:
        self.provider = LosingProvider()

    async def names(self, run: Run) -> dict[str, Any]:
        from fastapi import FastAPI

        app = FastAPI()
        app.add_middleware(IdempotencyMiddleware, store=MemoryStore())

        def receipt(charge: dict[str, str]) -> dict[str, str]:
            return {"paymentId": charge["ref"], "amount": charge["amount"]}

        return {
            "app": app,
            "idempotent": idempotent,
            "Request": Request,
            "Payment": Payment,
            "provider": self.provider,
            "receipt": receipt,
        }

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        key = {"Idempotency-Key": "pay-once"}
        async with serve(namespace["app"], raise_app_exceptions=False) as client:
            lost = await client.post("/payments", json=PAYMENT, headers=key)
            assert lost.status_code == 500
            retry = await client.post("/payments", json=PAYMENT, headers=key)
            assert retry.status_code == 200, retry.text
            [ref] = self.provider.calls  # reconciled, not charged again
            assert retry.json() == {"paymentId": ref, "amount": "9.99"}
            assert re.fullmatch(r"[A-Za-z0-9_-]{43}", ref)  # a derived key: not the client's
            replay = await client.post("/payments", json=PAYMENT, headers=key)
            assert replay.headers["x-idempotent-replay"] == "true"
            assert replay.json() == retry.json()


class AppContext(Context):
    """``app`` (a Starlette app with an ``@idempotent`` POST /orders, no middleware yet) and
    ``store``: the metrics block adds the middleware, and a request and its retry show up in
    its registry."""

    async def names(self, run: Run) -> dict[str, Any]:
        @idempotent()
        async def order(request: Request) -> JSONResponse:
            return JSONResponse({"orderId": "o_1"}, status_code=201)

        app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
        return {"app": app, "store": MemoryStore()}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        async with serve(namespace["app"], raise_app_exceptions=True) as client:
            for _ in range(2):
                await client.post("/orders", json={"items": [1]}, headers={"Idempotency-Key": "k"})
        registry = namespace["registry"]
        for result in ("ACQUIRED", "REPLAYED"):
            labels = {"endpoint": "POST /orders", "result": result}
            assert registry.get_sample_value("idempotency_requests_total", labels) == 1.0


class RedisClientsContext(Context):
    """The store constructors: ``RedisStore``, the ``redis`` and ``glide`` modules, and a
    glide ``config`` for the tests' Redis. Clients built on a client of your own are not
    closed by the store, so the test records the glide clients the block creates, to close
    them; the last store must answer from the tests' Redis."""

    async def names(self, run: Run) -> dict[str, Any]:
        import glide
        import redis

        from starlette_idempotency import RedisStore

        address = urlsplit(run.fixture("redis_url"))
        config = glide.GlideClientConfiguration(
            [glide.NodeAddress(address.hostname or "127.0.0.1", address.port or 6379)]
        )
        created: list[Any] = []
        create = glide.GlideClient.create

        async def recording_create(config: Any) -> Any:
            client = await create(config)
            created.append(client)
            return client

        async def close_created() -> None:
            for client in created:
                await client.close()

        run.monkeypatch.setattr(glide.GlideClient, "create", recording_create)
        run.stack.push_async_callback(close_created)
        return {"RedisStore": RedisStore, "redis": redis, "glide": glide, "config": config}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        from starlette_idempotency import RedisStore

        store = namespace["store"]
        assert isinstance(store, RedisStore)
        assert await store.get(f"readme-{uuid.uuid4().hex}") is None


class PostgresContext(Context):
    """``PostgresStore``; the DSN is the run's own database (``SUBSTITUTIONS``). After
    ``create_schema`` the store reads from its table."""

    async def names(self, run: Run) -> dict[str, Any]:
        from starlette_idempotency import PostgresStore

        return {"PostgresStore": PostgresStore}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        assert await namespace["store"].get("readme") is None


class ClientContext(Context):
    """``payment``, and in place of the network (the block posts to api.example.com) an
    in-process server guarded by the middleware: httpx's default transport is swapped for an
    ASGI transport. The README: the transport adds a UUID4 ``Idempotency-Key``."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []

    async def names(self, run: Run) -> dict[str, Any]:
        @idempotent()
        async def pay(request: Request) -> JSONResponse:
            self.keys.append(request.headers.get("idempotency-key"))
            return JSONResponse({"paymentId": "p_1", **await request.json()}, status_code=201)

        server = Starlette(
            routes=[Route("/payments", pay, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore())],
        )
        run.monkeypatch.setattr(
            httpx, "AsyncHTTPTransport", lambda *args, **kwargs: httpx.ASGITransport(server)
        )
        return {"payment": dict(PAYMENT)}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        response = namespace["response"]
        assert response.status_code == 201
        assert response.json() == {"paymentId": "p_1", **PAYMENT}
        (key,) = self.keys
        assert key is not None
        assert uuid.UUID(key).version == 4


class ErrorEnvelopeContext(Context):
    """``app`` (a Starlette app with an ``@idempotent`` POST /orders, no middleware yet),
    ``store`` and ``IdempotencyMiddleware``: the block adds the middleware with an
    ``error_format`` of its own, and a request without a key gets that envelope."""

    async def names(self, run: Run) -> dict[str, Any]:
        @idempotent()
        async def order(request: Request) -> JSONResponse:
            return JSONResponse({"orderId": "o_1"}, status_code=201)

        app = Starlette(routes=[Route("/orders", order, methods=["POST"])])
        return {"app": app, "store": MemoryStore(), "IdempotencyMiddleware": IdempotencyMiddleware}

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        async with serve(namespace["app"], raise_app_exceptions=True) as client:
            response = await client.post("/orders", json={"items": [1]})
        assert response.status_code == 400
        assert response.json() == {
            "ok": False,
            "error": {
                "code": "idempotency_key_missing",
                "detail": "Idempotency-Key header is required",
            },
        }


class WebhookContext(Context):
    """A receiver of the webhooks how-to: its secret in the environment; a signed delivery
    runs once and its retry is replayed, a forged one is refused and runs nothing."""

    SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the Standard Webhooks spec's example

    def __init__(self, provider: str) -> None:
        self.provider = provider

    async def names(self, run: Run) -> dict[str, Any]:
        for name in ("STRIPE_WEBHOOK_SECRET", "GITHUB_WEBHOOK_SECRET", "WEBHOOK_SECRET"):
            run.monkeypatch.setenv(name, self.SECRET)
        return {}

    def signed(self, body: bytes, delivery: str) -> dict[str, str]:
        import base64
        import hashlib
        import hmac
        import time

        now = str(int(time.time()))
        secret = self.SECRET.encode()
        if self.provider == "stripe":
            digest = hmac.new(secret, f"{now}.".encode() + body, hashlib.sha256).hexdigest()
            return {"Stripe-Signature": f"t={now},v1={digest}"}
        if self.provider == "github":
            digest = hmac.new(secret, body, hashlib.sha256).hexdigest()
            return {"X-GitHub-Delivery": delivery, "X-Hub-Signature-256": f"sha256={digest}"}
        key = base64.b64decode(self.SECRET.removeprefix("whsec_"))
        signed = hmac.new(key, f"{delivery}.{now}.".encode() + body, hashlib.sha256).digest()
        return {
            "webhook-id": delivery,
            "webhook-timestamp": now,
            "webhook-signature": "v1," + base64.b64encode(signed).decode(),
        }

    async def check(self, namespace: dict[str, Any], run: Run) -> None:
        (path,) = [
            route.path for route in namespace["app"].routes if route.path.startswith("/webhooks")
        ]
        await self.check_senders_apart(namespace["app"])
        delivery = f"evt_{uuid.uuid4().hex}"
        body = json.dumps({"id": delivery, "type": "test", "data": {"object": {}}}).encode()
        headers = {"Content-Type": "application/json", **self.signed(body, delivery)}
        async with serve(namespace["app"], raise_app_exceptions=True) as client:
            forged = {**headers, **self.signed(b"another body", delivery)}
            refused = await client.post(path, content=body, headers=forged)
            assert refused.status_code in (400, 401), refused.text
            for name, value in self.signed(body, delivery).items():
                # Starlette reads a header as latin-1, and "²" is a digit to str.isdigit().
                garbled = httpx.Headers({**headers, name: value + "²"}, encoding="latin-1")
                refused = await client.post(path, content=body, headers=garbled)
                assert refused.status_code in (400, 401), (name, refused.text)
            first = await client.post(path, content=body, headers=headers)
            assert first.status_code == 200, first.text
            assert first.json() == {"received": True}
            retry = await client.post(path, content=body, headers=headers)
            assert retry.headers["x-idempotent-replay"] == "true"

    @staticmethod
    async def check_senders_apart(app: FastAPI) -> None:
        """One route for many senders, under the page's ``key_scope``: the same event id from
        two senders is two events, each run (the storage key holds the route's template)."""

        @app.post("/senders/{sender}")
        @idempotent(key_from=KeySource.json_field("id"))
        async def sender_webhook(sender: str) -> dict[str, str]:
            return {"sender": sender}

        async with serve(app, raise_app_exceptions=True) as client:
            for sender in ("acme", "globex"):
                event = {"id": 1001, "sender": sender}
                response = await client.post(f"/senders/{sender}", json=event)
                assert response.json() == {"sender": sender}, response.text


CONTEXTS: dict[str, Callable[[], Context]] = {
    "app": AppContext,
    "client": ClientContext,
    "error-envelope": ErrorEnvelopeContext,
    "payments": PaymentsContext,
    "postgres": PostgresContext,
    "redis-clients": RedisClientsContext,
    "stripe-webhooks": lambda: WebhookContext("stripe"),
    "github-webhooks": lambda: WebhookContext("github"),
    "standard-webhooks": lambda: WebhookContext("standard"),
}


# --- the pages' blocks ---------------------------------------------------------------------


def example_id(found: PageExample) -> str:
    marker = found.example.code.marker
    suffix = "" if marker is None else f"-{marker.context or 'skip'}"
    line = f"line{found.example.code.line}{suffix}"
    return line if found.page == README else f"{found.name}:{line}"


#: Contexts whose names reach the tests' Redis or PostgreSQL.
SERVER_CONTEXTS = frozenset({"postgres", "redis-clients"})


def with_servers_marked(found: PageExample) -> Any:
    """``found``, marked ``services`` when its block reaches a server (``task test:unit``
    leaves those out): through a substitution, or through its context's names."""
    block = found.example.code
    reaches = any(substitution.literal in block.source for substitution in SUBSTITUTIONS) or (
        block.marker is not None and block.marker.context in SERVER_CONTEXTS
    )
    return pytest.param(found, marks=[pytest.mark.services] if reaches else [])


@pytest.mark.parametrize("found", [with_servers_marked(f) for f in EXAMPLES], ids=example_id)
async def test_readme_python_block(
    found: PageExample, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    example = found.example
    block, marker = example.code, example.code.marker
    if marker is not None and marker.skip is not None:
        pytest.skip(f"{found.name}:{block.line}: {marker.skip}")
    if marker is not None and marker.context not in CONTEXTS:
        pytest.fail(f"{found.name}:{marker.line}: no context {marker.context!r} in CONTEXTS")
    context = Context() if marker is None else CONTEXTS[str(marker.context)]()
    # A block may configure logging (the JSON formatter example): keep it to this test.
    library_logger = logging.getLogger("starlette_idempotency")
    handlers, level = list(library_logger.handlers), library_logger.level
    request.addfinalizer(lambda: setattr(library_logger, "handlers", handlers))
    request.addfinalizer(lambda: library_logger.setLevel(level))  # clears isEnabledFor's cache
    async with AsyncExitStack() as stack:
        run = Run(request, monkeypatch, stack)
        namespace = await execute(found.page, block, run, await context.names(run))
        app = namespace.get("app")
        if example.transcripts:
            assert app is not None, f"{found.name}:{block.line}: a transcript follows, but no app"
            async with serve(app, raise_app_exceptions=True) as client:
                for transcript in example.transcripts:
                    await replay(found.page, transcript, client)
        elif marker is None and app is not None:
            async with lifespan(app):  # it starts and stops
                pass
        await context.check(namespace, run)


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_python_fence_is_read(page: Path) -> None:
    """The blocks found equal the Python fences a plain line search finds."""
    fences = re.findall(
        r"(?m)^ {0,3}(?:```|~~~)[`~]*\s*(?:python3?|py)\b", page.read_text(encoding="utf-8")
    )
    assert len([block for block in read_page(page) if block.is_python]) == len(fences)
    assert fences or page != README


def test_no_block_imports_a_private_module() -> None:
    """What the pages show a user imports public names only (from the root, ``stores``,
    ``testing``, ``client`` ...), never ``starlette_idempotency._something``."""
    private = re.compile(r"\bstarlette_idempotency(?:\.\w+)*\._\w")
    assert [
        f"{found.name}:{found.example.code.line}"
        for found in EXAMPLES
        if private.search(found.example.code.source)
    ] == []


def test_every_context_is_used() -> None:
    used = {found.example.code.marker.context for found in EXAMPLES if found.example.code.marker}
    assert used >= set(CONTEXTS), f"contexts no block uses: {set(CONTEXTS) - used}"


def test_the_quick_starts_are_replayed() -> None:
    replayed = [found for found in EXAMPLES if found.page == README and found.example.transcripts]
    assert len(replayed) >= 2, "the README's FastAPI and Starlette quick starts have transcripts"


def test_the_pages_not_run_exist() -> None:
    assert all(page.is_file() for page in NOT_RUN), NOT_RUN


# --- the reader itself ------------------------------------------------------------------------

SAMPLE = """\
# Title

```python
first = 1
```

<!-- readme-test: context=payments -->

```py
second = 2
```

Some prose.
<!-- readme-test: skip (needs a package the tests do not install) -->
~~~python title="x.py"
third = 3
~~~

   ````python
   code = '''
   ```
   '''
   ````

```bash
./task test
```

```console
$ curl -si -X POST localhost:8000/orders -H 'Idempotency-Key: k' \\
    -H 'Content-Type: application/json' -d '{"items":[1]}'
HTTP/1.1 201 Created
x-idempotent-replay: true
{"orderId":"o_1"}
$ curl -si localhost:8000/orders -d 'a=1'
HTTP/1.1 422 Unprocessable Entity
```
"""


def test_read_blocks_finds_every_block_with_its_line_and_marker() -> None:
    blocks = read_blocks(SAMPLE)
    assert [(block.language, block.line, block.marker) for block in blocks] == [
        ("python", 3, None),
        ("py", 9, Marker(7, context="payments")),
        ("python", 15, Marker(14, skip="needs a package the tests do not install")),
        ("python", 19, None),
        ("bash", 25, None),
        ("console", 29, None),
    ]
    assert blocks[0].source == "first = 1\n"
    assert blocks[3].source == "code = '''\n```\n'''\n"  # the shorter fence stays inside
    assert [block.is_python for block in blocks] == [True, True, True, True, False, False]
    assert [block.is_transcript for block in blocks] == [False] * 5 + [True]


def test_read_examples_pairs_transcripts_with_the_block_before_them() -> None:
    examples = read_examples(read_blocks(SAMPLE))
    assert [(example.code.line, len(example.transcripts)) for example in examples] == [
        (3, 0),
        (9, 0),
        (15, 0),
        (19, 1),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- readme-test: context=x -->\nprose\n```python\n```\n", "right before a code block"),
        ("<!-- readme-test: context=x -->\n", "before no code block"),
        ("<!-- readme-test: sikp -->\n```python\n```\n", "not 'sikp'"),
        ("<!-- readme-test: skip () -->\n```python\n```\n", "not 'skip ()'"),
        ("text <!-- readme-test: skip (x) --> text\n```python\n```\n", "alone on its line"),
        ("<!-- readme-test: skip (a) -->\n<!-- readme-test: skip (b) -->\n", "two markers"),
        ("```python\nx = 1\n", "never closed"),
    ],
)
def test_read_blocks_refuses_what_it_would_have_to_ignore(text: str, message: str) -> None:
    with pytest.raises(ReadmeError, match=re.escape(message)):
        read_blocks(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("```console\n$ curl -si localhost/x\nHTTP/1.1 200 OK\n```\n", "before any Python"),
        ("<!-- readme-test: skip (x) -->\n```python\n```\n```console\n$ curl x\n```\n", "skipped"),
        ("```bash\ncurl -si localhost/x\n```\n", "write curl lines as a transcript"),
        ("<!-- readme-test: context=x -->\n```bash\n./task\n```\n", "only Python blocks"),
    ],
)
def test_read_examples_refuses_what_would_never_run(text: str, message: str) -> None:
    with pytest.raises(ReadmeError, match=re.escape(message)):
        read_examples(read_blocks(text))


def test_read_transcript_parses_commands_and_what_they_show() -> None:
    first, second = read_transcript(read_blocks(SAMPLE)[-1])
    assert first.line == 30
    assert first.request.method == "POST"
    assert first.request.url == "http://localhost:8000/orders"
    assert first.request.headers == (
        ("Idempotency-Key", "k"),
        ("Content-Type", "application/json"),
    )
    assert first.request.body == b'{"items":[1]}'
    assert first.response == ShownResponse(
        201, "Created", (("x-idempotent-replay", "true"),), '{"orderId":"o_1"}'
    )
    assert second.line == 35
    assert second.response == ShownResponse(422, "Unprocessable Entity", (), None)


def test_curl_data_is_a_form_unless_a_content_type_is_given() -> None:
    """curl's -d sends application/x-www-form-urlencoded: a JSON body needs its header."""
    form = parse_curl("curl localhost:8000/orders -d '{\"items\":[1]}'")
    assert form.method == "POST"
    assert form.headers == (("Content-Type", "application/x-www-form-urlencoded"),)
    sent_json = parse_curl("curl -X PATCH https://h/x --json '{}'")
    assert (sent_json.method, sent_json.url) == ("PATCH", "https://h/x")
    assert sent_json.headers == (
        ("Content-Type", "application/json"),
        ("Accept", "application/json"),
    )
    assert parse_curl("curl -s h/x").method == "GET"


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("curl -si -L localhost/x", "option -L"),
        ("curl localhost/x -d @body.json", "from a file"),
        ("curl localhost/x localhost/y", "two URLs"),
        ("curl -si", "without a URL"),
        ("curl -H", "needs a value"),
        ("http POST localhost/x", "only curl"),
    ],
)
def test_parse_curl_refuses_what_it_cannot_replay(command: str, message: str) -> None:
    with pytest.raises(ReadmeError, match=re.escape(message)):
        parse_curl(command)


def test_a_transcript_response_must_show_a_status_line() -> None:
    block = read_blocks("```console\n$ curl localhost/x\n{}\n```\n")[0]
    with pytest.raises(ReadmeError, match=re.escape("README.md:2: show the response's status")):
        read_transcript(block)


def test_differences_name_what_the_response_does_not_show() -> None:
    response = httpx.Response(201, headers={"x-a": "1"}, content=b'{"b":2}')
    shown = ShownResponse(201, "Created", (("x-a", "1"),), '{"b": 2}')
    assert differences(shown, response) == []
    wrong = ShownResponse(200, "Created", (("x-idempotent-replay", "true"),), '{"b": 3}')
    assert differences(wrong, response) == [
        "status 201, the README shows 200",
        "reason 'Created' is not the phrase of 200",
        "header x-idempotent-replay: absent, the README shows 'true'",
        "body '{\"b\":2}', the README shows '{\"b\": 3}'",
    ]
