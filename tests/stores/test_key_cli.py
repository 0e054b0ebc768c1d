"""``starlette-idempotency show | delete | resolve | list``, run as a subprocess against a real
Redis and PostgreSQL, on records the middleware wrote."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Host, Route

from starlette_idempotency import (
    IdempotencyMiddleware,
    IdempotencyStore,
    PostgresStore,
    RedisStore,
    ResponseEncryption,
    checkpoint,
    idempotent,
)
from starlette_idempotency.testing._isolation import (
    delete_prefixed_at,
    unique_prefix,
    unique_table,
)
from tests.support.cli import Ran
from tests.support.cli import cli as run_cli

SECRET = ResponseEncryption.generate_key()
KEY_ENV = {"PAYMENTS_IDEMPOTENCY_KEY": SECRET}


@dataclass
class Setup:
    """A guarded app on the store, and the CLI options that reach the same store."""

    client: httpx.AsyncClient
    store_args: tuple[str, ...]
    running: asyncio.Event
    release: asyncio.Event
    store: IdempotencyStore

    async def cli(self, *args: str, env: dict[str, str] | None = None) -> Ran:
        command, *rest = args
        return await asyncio.to_thread(run_cli, command, *self.store_args, *rest, env=env)

    async def pay(self, key: str, path: str = "/payments", **body: object) -> httpx.Response:
        headers = {"Idempotency-Key": key, "X-Client-Id": "acme"}
        return await self.client.post(path, json=body or {"amount": "9.99"}, headers=headers)


def build_app(
    store: IdempotencyStore,
    running: asyncio.Event,
    release: asyncio.Event,
    replay_header_name: str = "X-Idempotent-Replay",
) -> Starlette:
    @idempotent()
    async def payments(request: Request) -> Response:
        return JSONResponse({"paymentId": "p_1", "amount": "9.99"}, status_code=201)

    @idempotent(on_recovery="hold")
    async def charges(request: Request) -> Response:
        await checkpoint(request, "provider_charge_sent", {"providerRef": "ch_9"})
        return JSONResponse({"error": "provider timed out"}, status_code=502)

    @idempotent(lock_ttl_seconds=60)
    async def slow(request: Request) -> Response:
        await checkpoint(request, "started", None)
        running.set()
        await release.wait()
        return JSONResponse({"done": True}, status_code=201)

    @idempotent(operation="payments.create")
    async def named_payments(request: Request) -> Response:
        return JSONResponse({"paymentId": "p_2"}, status_code=201)

    def scope(connection: HTTPConnection) -> str:
        return connection.headers["x-client-id"]

    tenants = Starlette(
        routes=[
            Route("/payments", payments, methods=["POST"]),
            Route("/v2/payments", named_payments, methods=["POST"]),
        ]
    )
    app = Starlette(
        routes=[
            Host("{tenant}.example.com", tenants),
            Route("/payments", payments, methods=["POST"]),
            Route("/charges", charges, methods=["POST"]),
            Route("/slow/{n}", slow, methods=["POST"]),
        ]
    )
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        key_scope=scope,
        encryption=ResponseEncryption({"2026-12": SECRET}),
        replay_header_name=replay_header_name,
    )
    return app


@dataclass
class Backend:
    kind: str
    url: str
    name: str  # the Redis key prefix, or the PostgreSQL table


@pytest.fixture(
    params=[
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "redis":
        return Backend("redis", request.getfixturevalue("redis_url"), unique_prefix())
    return Backend("postgres", request.getfixturevalue("postgres_dsn"), unique_table())


@pytest.fixture
async def setup(backend: Backend) -> AsyncIterator[Setup]:
    store: RedisStore | PostgresStore
    if backend.kind == "redis":
        store = RedisStore.from_url(backend.url, key_prefix=backend.name)
        args = ("--redis", backend.url, "--key-prefix", backend.name)
    else:
        store = PostgresStore.from_dsn(backend.url, table=backend.name)
        await store.create_schema()
        args = ("--dsn", backend.url, "--table", backend.name)
    running, release = asyncio.Event(), asyncio.Event()
    transport = httpx.ASGITransport(app=build_app(store, running, release))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield Setup(client, args, running, release, store)
            release.set()
    finally:
        await store.aclose()
        if backend.kind == "redis":
            await delete_prefixed_at(backend.url, backend.name)


ADDRESS = ("--scope", "acme", "--route")


async def test_show_a_completed_key_its_body_only_when_asked(setup: Setup) -> None:
    assert (await setup.pay("k-1")).status_code == 201
    shown = await setup.cli("show", *ADDRESS, "/payments", "k-1")
    assert shown.code == 0, shown.err
    assert shown.lines[:2] == ["storage key: acme:POST:/payments:k-1", "status: Completed"]
    assert "response: 201, sealed with key 2026-12" in shown.lines
    assert "9.99" not in shown.out

    sealed = await setup.cli("show", *ADDRESS, "/payments", "k-1", "--body")
    assert sealed.code == 1
    assert "sealed with key '2026-12', which no --encryption-key given opens" in sealed.err
    assert "pass --encryption-key 2026-12=ENV_VAR" in sealed.err

    opened = await setup.cli(
        "show",
        *ADDRESS,
        "/payments",
        "k-1",
        "--body",
        "--json",
        "--encryption-key",
        "2026-12=PAYMENTS_IDEMPOTENCY_KEY",
        env=KEY_ENV,
    )
    assert opened.code == 0, opened.err
    view = json.loads(opened.out)
    assert view["status"] == "Completed"
    assert (view["scope"], view["method"], view["route"], view["key"]) == (
        "acme",
        "POST",
        "/payments",
        "k-1",
    )
    assert view["sealedWith"] == "2026-12"
    assert view["responseStatusCode"] == 201
    assert json.loads(view["responseBody"]) == {"paymentId": "p_1", "amount": "9.99"}
    assert ["content-type", "application/json"] in view["responseHeaders"]


async def test_a_route_under_a_host_is_found_as_the_help_says(setup: Setup) -> None:
    """Under a Host route the storage key holds the host the request matched followed directly
    by the template or the operation= name, nothing between them (a changed key would run the
    retries in flight across an upgrade again): --route's help shows both."""
    for path in ("/payments", "/v2/payments"):
        assert (await setup.pay("k-h", f"http://api.example.com{path}")).status_code == 201
    usage = await asyncio.to_thread(run_cli, "show", "--help")
    for route in ("api.example.com/payments", "api.example.compayments.create"):
        assert route in usage.out
        shown = await setup.cli("show", *ADDRESS, route, "k-h")
        assert shown.code == 0, shown.err
        assert shown.lines[:2] == [f"storage key: acme:POST:{route}:k-h", "status: Completed"]


async def test_a_held_key_is_listed_as_stuck_then_resolved(setup: Setup) -> None:
    assert (await setup.pay("k-2", "/charges")).status_code == 502
    held = await setup.pay("k-2", "/charges")
    assert held.status_code == 202
    assert held.json()["status"] == "requires_recovery"

    stuck = await setup.cli("list", "--stuck", "--json")
    assert stuck.code == 0, stuck.err
    [entry] = json.loads(stuck.out)
    assert entry["storageKey"] == "acme:POST:/charges:k-2"
    assert entry["leaseExpired"] is True
    assert entry["recoveryPoints"] == ["provider_charge_sent"]

    shown = await setup.cli("show", *ADDRESS, "/charges", "k-2")
    assert "status: InProgress" in shown.lines
    assert any(
        line.startswith("lease: lease until ") and "(run out)" in line for line in shown.lines
    )
    assert "  provider_charge_sent at " in shown.out
    assert '{"providerRef":"ch_9"}' in shown.out

    resolved = await setup.cli(
        "resolve",
        *ADDRESS,
        "/charges",
        "k-2",
        "--status",
        "201",
        "--body",
        '{"chargeId":"ch_9"}',
        "--encryption-key",
        "2026-12=PAYMENTS_IDEMPOTENCY_KEY",
        env=KEY_ENV,
    )
    assert resolved.code == 0, resolved.err
    assert resolved.out.strip() == "resolved: acme:POST:/charges:k-2 (Completed)"
    replay = await setup.pay("k-2", "/charges")
    assert replay.status_code == 201
    assert replay.json() == {"chargeId": "ch_9"}
    assert replay.headers["content-type"] == "application/json"
    assert replay.headers["x-idempotent-replay"] == "true"
    assert (await setup.cli("list", "--stuck")).lines == ["0 record(s) held for recovery"]

    again = await setup.cli("resolve", *ADDRESS, "/charges", "k-2", "--status", "201")
    assert again.code == 1
    assert "is already Completed" in again.err


async def test_a_running_key_is_listed_but_not_stuck_and_kept_without_force(setup: Setup) -> None:
    first = asyncio.create_task(setup.pay("k-3", "/slow/7"))
    async with asyncio.timeout(10):
        await setup.running.wait()
    listed = await setup.cli("list")
    assert listed.code == 0, listed.err
    assert listed.lines[0].startswith("POST /slow/{n}  key k-3  scope acme  created ")
    assert "running, lease until" in listed.lines[0]
    assert listed.lines[-1] == "1 record(s) in progress"
    assert (await setup.cli("list", "--stuck", "--json")).out.strip() == "[]"

    kept = await setup.cli("delete", *ADDRESS, "/slow/{n}", "k-3")
    assert kept.code == 1
    assert "may still be running" in kept.err
    assert "--force" in kept.err
    setup.release.set()
    assert (await first).status_code == 201


async def test_delete_frees_the_key_for_the_next_retry(setup: Setup) -> None:
    assert (await setup.pay("k-4")).status_code == 201
    deleted = await setup.cli("delete", *ADDRESS, "/payments", "k-4", "--json")
    assert deleted.code == 0, deleted.err
    assert json.loads(deleted.out) == {
        "deleted": True,
        "storageKey": "acme:POST:/payments:k-4",
        "scope": "acme",
        "method": "POST",
        "route": "/payments",
        "key": "k-4",
        "status": "Completed",
    }
    again = await setup.pay("k-4")
    assert again.status_code == 201
    assert "x-idempotent-replay" not in again.headers

    missing = await setup.cli("show", *ADDRESS, "/payments", "no-such-key")
    assert missing.code == 1
    assert "no record under 'acme:POST:/payments:no-such-key'" in missing.err
    assert "check --key-prefix, --scope, --method and --route" in missing.err


async def test_bad_usage_is_status_2(setup: Setup) -> None:
    no_route = await setup.cli("show", "k")
    assert no_route.code == 2
    assert "--route" in no_route.err
    unset = await setup.cli("show", *ADDRESS, "/p", "k", "--encryption-key", "a=NO_SUCH_VAR")
    assert unset.code == 2
    assert "NO_SUCH_VAR is not set" in unset.err
    cookie = await setup.cli(
        "resolve", *ADDRESS, "/p", "k", "--status", "200", "--header", "set-cookie: a=b"
    )
    assert cookie.code == 2
    assert "set-cookie: this header is never stored" in cookie.err


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (("--status", "101"), "--status must be a final HTTP status code (200 to 599), not 101"),
        (("--status", "204", "--body", "{}"), "--status 204 is answered without a body"),
        (("--status", "205", "--body", "{}"), "--status 205 is answered without a body"),
        (("--header", "x-idempotent-replay: false"), "x-idempotent-replay: this header is never"),
        (("--header", "Idempotent-Replayed: true"), "idempotent-replayed: this header is never"),
        (
            ("--replay-header-name", "X-Replayed", "--header", "X-Replayed: false"),
            "--header x-replayed: this header is never stored: it is a replay header",
        ),
        (
            ("--replay-header-name", "X Replayed"),
            "--replay-header-name must be an HTTP header name such as 'X-Idempotent-Replay', "
            "not 'X Replayed'",
        ),
        (("--header", "x-note: paid 10\u20ac"), "the value must be Latin-1 text"),
        (("--header", "x bad: 1"), "--header takes 'NAME: VALUE' with a name of letters"),
        (
            ("--body", "{}", "--content-type", "text/plain\nx-note: 1"),
            "--content-type: the value must be Latin-1 text without control characters",
        ),
        (
            ("--body", "{}", "--content-type", "text/plain; charset=\udcff"),
            "--content-type: the value must be Latin-1 text without control characters",
        ),
    ],
)
async def test_a_response_no_replay_can_send_is_refused(
    setup: Setup, options: tuple[str, ...], refusal: str
) -> None:
    """Each was stored and reported resolved, and every retry after it then failed: a 500,
    a dropped connection, a 204 announcing a body it did not send, a 205 with content (RFC 9110
    forbids it), or a replay header twice."""
    assert (await setup.pay("k-6", "/charges")).status_code == 502
    status = () if "--status" in options else ("--status", "201")
    refused = await setup.cli("resolve", *ADDRESS, "/charges", "k-6", *status, *options)
    assert refused.code == 2
    assert refusal in refused.err
    assert (await setup.pay("k-6", "/charges")).status_code == 202


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (
            ("show", *ADDRESS, "/charges", "k-\udcff"),
            "argument KEY: not UTF-8 text (byte 0xff at offset 2)",
        ),
        (
            ("delete", "--scope", "acme\udce9", "--route", "/charges", "k-10"),
            "argument --scope: not UTF-8 text (byte 0xe9 at offset 4)",
        ),
        (
            ("resolve", *ADDRESS, "/charges\udcff", "k-10", "--status", "201"),
            "argument --route: not UTF-8 text (byte 0xff at offset 8)",
        ),
        (
            ("resolve", *ADDRESS, "/charges", "k-10", "--status", "201", "--body", "\udcff{}"),
            "argument --body: not UTF-8 text (byte 0xff at offset 0): check the terminal's "
            "encoding and the quoting; pass a body of other bytes with --body-file",
        ),
        (("list", "--key-prefix", "\udcff"), "argument --key-prefix: not UTF-8 text"),
    ],
)
async def test_text_that_is_not_utf8_is_bad_usage(
    setup: Setup, args: tuple[str, ...], refusal: str
) -> None:
    """A key, route, scope or body that is not UTF-8 on the command line (the child gets the
    bytes these surrogates escape) ended in a UnicodeEncodeError's traceback, exit status 1."""
    assert (await setup.pay("k-10", "/charges")).status_code == 502
    refused = await setup.cli(*args)
    assert refused.code == 2, refused.err
    assert refusal in refused.err
    assert (await setup.pay("k-10", "/charges")).status_code == 202


@pytest.mark.parametrize(
    ("name", "error"), [("missing.json", "No such file or directory"), (".", "Is a directory")]
)
async def test_a_body_file_that_cannot_be_read_is_bad_usage(
    setup: Setup, tmp_path: Path, name: str, error: str
) -> None:
    """``--body-file`` naming a missing file or a directory ended in a FileNotFoundError's or
    an IsADirectoryError's traceback, exit status 1."""
    assert (await setup.pay("k-11", "/charges")).status_code == 502
    path = tmp_path / name
    refused = await setup.cli(
        "resolve", *ADDRESS, "/charges", "k-11", "--status", "201", "--body-file", str(path)
    )
    assert refused.code == 2, refused.err
    assert f"--body-file {path}: {error}: pass a file this user can read, or -" in refused.err
    assert (await setup.pay("k-11", "/charges")).status_code == 202

    body = tmp_path / "body.json"
    body.write_bytes(b'{"chargeId":"ch_9"}')
    resolved = await setup.cli(
        "resolve", *ADDRESS, "/charges", "k-11", "--status", "201", "--body-file", str(body)
    )
    assert resolved.code == 0, resolved.err
    assert (await setup.pay("k-11", "/charges")).json() == {"chargeId": "ch_9"}


async def test_resolve_refuses_the_apps_own_replay_header_as_told(setup: Setup) -> None:
    """With ``replay_header_name="X-Replayed"``, ``--header 'X-Replayed: false'`` was stored,
    and every replay carried the header twice: ``--replay-header-name`` names it."""
    app = build_app(setup.store, setup.running, setup.release, replay_header_name="X-Replayed")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        own = replace(setup, client=client)
        assert (await own.pay("k-9", "/charges")).status_code == 502
        resolve = ("resolve", *ADDRESS, "/charges", "k-9", "--status", "201")
        told = ("--replay-header-name", "X-Replayed")
        refused = await own.cli(*resolve, *told, "--header", "X-Replayed: false")
        assert refused.code == 2
        assert "--header x-replayed: this header is never stored" in refused.err
        resolved = await own.cli(*resolve, *told, "--header", "X-Note: settled by hand")
        assert resolved.code == 0, resolved.err
        replay = await own.pay("k-9", "/charges")
        assert replay.status_code == 201
        assert replay.headers.get_list("x-replayed") == ["true"]
        assert replay.headers["x-note"] == "settled by hand"


async def test_a_resolved_no_content_is_replayed_without_a_length(setup: Setup) -> None:
    assert (await setup.pay("k-7", "/charges")).status_code == 502
    resolved = await setup.cli("resolve", *ADDRESS, "/charges", "k-7", "--status", "204")
    assert resolved.code == 0, resolved.err
    replay = await setup.pay("k-7", "/charges")
    assert replay.status_code == 204
    assert "content-length" not in replay.headers
    assert replay.headers["x-idempotent-replay"] == "true"


async def test_a_resolved_reset_content_is_replayed_with_a_length_of_zero(setup: Setup) -> None:
    assert (await setup.pay("k-8", "/charges")).status_code == 502
    resolved = await setup.cli("resolve", *ADDRESS, "/charges", "k-8", "--status", "205")
    assert resolved.code == 0, resolved.err
    replay = await setup.pay("k-8", "/charges")
    assert (replay.status_code, replay.content) == (205, b"")
    assert replay.headers["content-length"] == "0"
    assert replay.headers.get_list("x-idempotent-replay") == ["true"]


@pytest.mark.parametrize("ttl_hours", ["0", "-1", "0.0001", "nan", "inf", "1e15"])
async def test_a_resolve_that_would_delete_the_record_is_refused(
    setup: Setup, ttl_hours: str
) -> None:
    """``--ttl-hours -1`` reported the record resolved, and deleted it: the retry that
    ``on_recovery="hold"`` held back then ran the handler again."""
    assert (await setup.pay("k-5", "/charges")).status_code == 502
    refused = await setup.cli(
        "resolve", *ADDRESS, "/charges", "k-5", "--status", "201", "--ttl-hours", ttl_hours
    )
    assert refused.code == 2
    assert "--ttl-hours: must be 0.000277778 to 876000, not" in refused.err
    held = await setup.pay("k-5", "/charges")
    assert held.status_code == 202
    assert (await setup.cli("list", "--limit", "0")).code == 2
