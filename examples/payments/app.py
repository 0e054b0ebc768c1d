"""The payments demo app: a FastAPI service whose writes are safe to retry on any pod.

Configured from the environment, so two uvicorn processes (or two containers) run the same
code as "pod-a" and "pod-b"::

    DATABASE_URL                PostgreSQL for the ledger (and the store, see below); required
    REDIS_URL                   Redis for the idempotency store (IDEMPOTENCY_STORE=redis)
    IDEMPOTENCY_STORE           redis (default) or postgres: PostgreSQL alone, no Redis
    POD_ID                      this process's name, in X-Pod-Id and the ledger rows
    PAYMENTS_LOCK_TTL_SECONDS   the in-progress lock of POST /payments (default 60)
    IDEMPOTENCY_KEY_PREFIX      Redis key prefix (default payments-demo)
    IDEMPOTENCY_REDIS_ACQUIRE   setnx (default) or lua
    DEMO_MAX_DELAY_MS           the longest demo delay a request may ask for (default 60000)
    DEMO_CRASH_HOOKS            1: honour X-Demo-Crash (tests and demos only; default off)

Run it with ``uvicorn --factory examples.payments.app:create_app``. The tables are created at
startup. ``GET /metrics/`` serves the middleware's Prometheus metrics (the monitoring kit,
``starlette-idempotency monitoring``, has the dashboard and the alerts that read them). A
request header ``X-Demo-Delay-Ms`` makes ``POST /payments`` sleep before it writes to the
ledger, so concurrent retries and crashes can be shown by hand; it is not part of the request
fingerprint (only headers named in ``fingerprint_headers`` are).

``POST /payments`` charges a (fake) payment provider with a key derived from the request's
(``idempotency_context(request).derived_key("provider.charge")``), so a second attempt gets the
first charge back, then writes the payment row and its ``payment.created`` outbox event in one
transaction. On ``PostgresStore`` (``IDEMPOTENCY_STORE=postgres``) the idempotency record
commits in that transaction too (``idempotency_transaction``): a pod that dies after the commit
leaves a finished record, and the retry is replayed. On ``RedisStore`` the record cannot join a
PostgreSQL transaction: the middleware stores it after the commit, and a crash in between runs
the payment again once the lock lapses (the provider still charges once). With
``DEMO_CRASH_HOOKS=1``, ``X-Demo-Crash: after-commit`` makes the pod SIGKILL itself right after
that commit, before the response.

``POST /charges`` is the same payment through a (fake) payment provider, with recovery
points: ``X-Demo-Delay-After-Provider-Ms`` makes it sleep after the provider charged and before
the ledger row, the window where a crash leaves an unknown outcome.

The API documents every answer it gives (``tests/e2e/test_schemathesis.py`` holds it to that):
its own errors share one body (:class:`ErrorOut`), and text that PostgreSQL cannot store
(U+0000) is refused with a 422 before it reaches the database.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel
from starlette.datastructures import MutableHeaders
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from examples.payments.ledger import DuplicateEmail, Ledger, Row, decode_items, iso
from starlette_idempotency import (
    IdempotencyMiddleware,
    IdempotencyStore,
    PostgresStore,
    PrometheusMetrics,
    checkpoint,
    idempotency_context,
    idempotency_transaction,
    idempotent,
    mark_retryable,
    readiness_route,
)
from starlette_idempotency.prometheus import metrics_app

logger = logging.getLogger(__name__)

StoreKind = Literal["redis", "postgres"]
AcquireStrategy = Literal["setnx", "lua"]
# PostgreSQL's text cannot hold U+0000: such input is a validation error (422), not a 500.
NO_NUL = r"^[^\x00]*$"
Text = Annotated[str, StringConstraints(pattern=NO_NUL)]

_STORES: dict[str, StoreKind] = {"redis": "redis", "postgres": "postgres"}
_ACQUIRE_STRATEGIES: dict[str, AcquireStrategy] = {"setnx": "setnx", "lua": "lua"}
_T = TypeVar("_T")


def _choice(env: Mapping[str, str], name: str, choices: Mapping[str, _T], default: str) -> _T:
    value = env.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return choices[value]


@dataclass(frozen=True)
class Settings:
    database_url: str | None
    redis_url: str | None = None
    store: StoreKind = "redis"
    pod_id: str = "pod-local"
    payments_lock_ttl_seconds: float = 60.0
    key_prefix: str = "payments-demo"
    redis_acquire: AcquireStrategy = "setnx"
    # Long enough to kill a pod mid-request by hand; short enough that no request parks forever.
    max_demo_delay_ms: int = 60_000
    # Off unless a test or a demo asks: X-Demo-Crash kills the pod.
    crash_hooks: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        store = _choice(env, "IDEMPOTENCY_STORE", _STORES, "redis")
        acquire = _choice(env, "IDEMPOTENCY_REDIS_ACQUIRE", _ACQUIRE_STRATEGIES, "setnx")
        return cls(
            database_url=env.get("DATABASE_URL") or None,
            redis_url=env.get("REDIS_URL") or None,
            store=store,
            pod_id=env.get("POD_ID", "pod-local"),
            payments_lock_ttl_seconds=float(env.get("PAYMENTS_LOCK_TTL_SECONDS", "60")),
            key_prefix=env.get("IDEMPOTENCY_KEY_PREFIX", "payments-demo"),
            redis_acquire=acquire,
            max_demo_delay_ms=int(env.get("DEMO_MAX_DELAY_MS", "60000")),
            crash_hooks=env.get("DEMO_CRASH_HOOKS") == "1",
        )


# --- request and response bodies (camelCase on the wire) -------------------------------------


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class PaymentIn(Model):
    account_id: Text = Field(min_length=1, max_length=64)
    amount: Decimal = Field(gt=0, max_digits=16, decimal_places=2)
    currency: str = Field(pattern=r"^[A-Z]{3}$")
    merchant_reference: Text = Field(min_length=1, max_length=200)


class Payment(Model):
    id: uuid.UUID
    account_id: str
    amount: Decimal
    currency: str
    merchant_reference: str
    pod: str
    created_at: str


EMAIL = r"^[^@\s\x00]+@[^@\s\x00]+$"


class MemberIn(Model):
    email: str = Field(pattern=EMAIL, max_length=254)
    name: Text = Field(min_length=1, max_length=200)


class MemberPatch(Model):
    email: str | None = Field(default=None, pattern=EMAIL, max_length=254)
    name: Text | None = Field(default=None, min_length=1, max_length=200)


class Member(Model):
    id: uuid.UUID
    email: str
    name: str
    pod: str
    created_at: str
    updated_at: str


class OrderItem(Model):
    sku: Text = Field(min_length=1, max_length=64)
    quantity: int = Field(gt=0, le=1000)


class OrderIn(Model):
    order_reference: Text = Field(min_length=1, max_length=200)
    account_id: Text = Field(min_length=1, max_length=64)
    items: list[OrderItem] = Field(min_length=1)
    # Change on every retry without changing what is ordered: excluded from the fingerprint.
    client_timestamp: Text | None = None
    request_nonce: Text | None = None


class Order(Model):
    id: uuid.UUID
    order_reference: str
    account_id: str
    items: list[OrderItem]
    pod: str
    created_at: str


def _payment(row: Row) -> Payment:
    return Payment(
        id=row["id"],
        account_id=row["account_id"],
        amount=row["amount"],
        currency=row["currency"],
        merchant_reference=row["merchant_reference"],
        pod=row["pod"],
        created_at=iso(row["created_at"]),
    )


def _member(row: Row) -> Member:
    return Member(
        id=row["id"],
        email=row["email"],
        name=row["name"],
        pod=row["pod"],
        created_at=iso(row["created_at"]),
        updated_at=iso(row["updated_at"]),
    )


def _order(row: Row) -> Order:
    return Order(
        id=row["id"],
        order_reference=row["order_reference"],
        account_id=row["account_id"],
        items=[OrderItem.model_validate(item) for item in decode_items(row["items"])],
        pod=row["pod"],
        created_at=iso(row["created_at"]),
    )


class OutboxEvent(Model):
    id: int
    event_type: str
    payload: dict[str, Any]
    created_at: str


def _outbox_event(row: Row) -> OutboxEvent:
    return OutboxEvent(
        id=row["id"],
        event_type=row["event_type"],
        payload=json.loads(row["payload"]),
        created_at=iso(row["created_at"]),
    )


class ErrorOut(BaseModel):
    """The body of the demo's own errors (the idempotency middleware documents its own)."""

    error: str
    code: str
    retryable: bool | None = None
    pod: str | None = None


def _error(status: int, code: str, message: str, **extra: Any) -> JSONResponse:
    body = ErrorOut(error=message, code=code, **extra).model_dump(exclude_none=True)
    return JSONResponse(body, status_code=status)


def _documented(status: int, description: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorOut, "description": description}}


# --- plumbing ----------------------------------------------------------------------------------


class PodIdHeader:
    """Adds ``X-Pod-Id`` to every response this process sends, replays and errors included.

    It wraps the whole app, outside the idempotency middleware, so a replay names the pod that
    answered it, while the body's ``pod`` names the pod that ran the request.
    """

    def __init__(self, app: ASGIApp, *, pod_id: str) -> None:
        self.app = app
        self.pod_id = pod_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_pod(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Pod-Id"] = self.pod_id
            await send(message)

        await self.app(scope, receive, send_with_pod)


def _store(settings: Settings) -> IdempotencyStore:
    """The idempotency store, built with the app: it connects on first use, in the server's
    event loop (the middleware's startup check), and the middleware closes it when the app
    stops."""
    if settings.store == "postgres":
        return PostgresStore.from_dsn(settings.database_url, max_size=10)
    if settings.redis_url is None:
        raise RuntimeError("REDIS_URL is required with IDEMPOTENCY_STORE=redis")
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from starlette_idempotency.stores.redis import RedisStore

    # One immediate retry on a fresh connection: after a Redis restart the pooled connections
    # are dead, and the first command on each should not cost the caller a 503.
    return RedisStore.from_url(
        settings.redis_url,
        key_prefix=settings.key_prefix,
        acquire=settings.redis_acquire,
        socket_connect_timeout=0.5,
        socket_timeout=1.0,
        retry=Retry(NoBackoff(), 1),
    )


def _key_scope(connection: HTTPConnection) -> str:
    # A real service scopes keys to the authenticated user or tenant; the demo has no auth, so
    # a client may name itself with X-Client-Id (keys of different clients never collide).
    return connection.headers.get("x-client-id", "anonymous")


# --- the app -----------------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> ASGIApp:
    """What uvicorn runs (``uvicorn --factory examples.payments.app:create_app``): the API,
    wrapped so that even the 500 of an unhandled error carries ``X-Pod-Id``."""
    settings = Settings.from_env() if settings is None else settings
    return PodIdHeader(build_api(settings), pod_id=settings.pod_id)


def build_api(settings: Settings) -> FastAPI:
    """The FastAPI app: its ledger opened and its tables created by its lifespan."""
    pod = settings.pod_id
    if settings.database_url is None:
        raise RuntimeError("DATABASE_URL is required")
    store = _store(settings)
    # Merchant references whose POST /payments is sleeping on X-Demo-Delay-Ms right now.
    delayed: set[str] = set()

    def delay_header() -> Any:
        # A default, not an annotation: FastAPI resolves annotations in the module's globals.
        return Header(0, ge=0, le=settings.max_demo_delay_ms)

    async def demo_delay(reference: str, milliseconds: int) -> None:
        delayed.add(reference)
        try:
            await asyncio.sleep(milliseconds / 1000)
        finally:
            delayed.discard(reference)

    def crash_after_commit(request: Request) -> None:
        """SIGKILL this pod, as a crash between the commit and the response would: out of the
        schema, and honoured only with DEMO_CRASH_HOOKS=1."""
        if settings.crash_hooks and request.headers.get("x-demo-crash") == "after-commit":
            os.kill(os.getpid(), signal.SIGKILL)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert settings.database_url is not None
        ledger = await Ledger.open(settings.database_url)
        try:
            await ledger.create_schema()
            if isinstance(store, PostgresStore):
                await store.create_schema()
            app.state.ledger = ledger
            logger.info("%s ready (idempotency store: %s)", pod, settings.store)
            yield
        finally:
            await ledger.close()

    app = FastAPI(title="payments demo", lifespan=lifespan)

    def ledger_of(request: Request) -> Ledger:
        ledger: Ledger = request.app.state.ledger
        return ledger

    @app.get("/healthz", responses=_documented(503, "The database cannot be reached."))
    async def healthz(request: Request) -> JSONResponse:
        try:
            ok = await ledger_of(request).ping()
        except Exception as exc:  # any database failure means "not ready"
            return _error(503, "database_unavailable", str(exc), pod=pod)
        return JSONResponse({"status": "ok" if ok else "degraded", "pod": pod})

    # Kubernetes probes (examples/payments/k8s/): ready while the idempotency store works,
    # alive while the event loop answers. Out of the schema: they are for the kubelet.
    app.router.routes.append(readiness_route(store, path="/ready"))

    @app.get("/livez", include_in_schema=False)
    async def livez() -> dict[str, str]:
        return {"status": "alive", "pod": pod}

    async def insert_payment(ledger: Ledger, body: PaymentIn, connection: Any = None) -> Row:
        """The payment ``body`` asks for, by this pod (on ``connection``, in its transaction)."""
        return await ledger.insert_payment(
            account_id=body.account_id,
            amount=body.amount,
            currency=body.currency,
            merchant_reference=body.merchant_reference,
            pod=pod,
            connection=connection,
        )

    async def write_payment(
        ledger: Ledger, connection: Any, body: PaymentIn, provider_ref: str
    ) -> JSONResponse:
        """The payment row and its outbox event, on ``connection`` (in its transaction)."""
        row = await insert_payment(ledger, body, connection)
        payment = _payment(row).model_dump(mode="json", by_alias=True)
        event = {**payment, "providerRef": provider_ref}
        await ledger.add_outbox_event(connection, "payment.created", event)
        return JSONResponse(payment)

    @app.post("/payments", response_model=Payment)
    @idempotent(ttl_hours=48, lock_ttl_seconds=settings.payments_lock_ttl_seconds)
    async def create_payment(
        body: PaymentIn,
        request: Request,
        x_demo_delay_ms: int = delay_header(),
    ) -> Response:
        """Charge the provider with a derived key, then commit the payment, its outbox event
        and (on PostgresStore) the idempotency record in one transaction."""
        ledger = ledger_of(request)
        # The same on every retry and after a takeover: the provider charges once for it.
        provider_ref = await ledger.provider_charge_once(
            idempotency_key=idempotency_context(request).derived_key("provider.charge"),
            merchant_reference=body.merchant_reference,
            amount=body.amount,
            currency=body.currency,
            pod=pod,
        )
        if x_demo_delay_ms:
            await demo_delay(body.merchant_reference, x_demo_delay_ms)
        async with ledger.connection() as connection:
            if isinstance(store, PostgresStore):
                # Fenced: the record's row is locked under this request's owner token, and
                # the outcome commits with the payment, or nothing does.
                async with idempotency_transaction(request, connection) as tx:
                    response = await tx.respond(
                        await write_payment(ledger, connection, body, provider_ref)
                    )
            else:
                # RedisStore cannot join a PostgreSQL transaction: the middleware stores the
                # outcome after this commit.
                async with connection.transaction():
                    response = await write_payment(ledger, connection, body, provider_ref)
        crash_after_commit(request)
        return response

    @app.post("/charges", response_model=Payment)
    @idempotent(ttl_hours=48, lock_ttl_seconds=settings.payments_lock_ttl_seconds)
    async def create_charge(
        body: PaymentIn,
        request: Request,
        x_demo_delay_after_provider_ms: int = delay_header(),
    ) -> Payment:
        """Charge through the provider, then write the ledger, with a recovery point before
        each step, so that a retry after a crash reconciles instead of charging again."""
        ledger = ledger_of(request)
        context = idempotency_context(request)
        saved: dict[str, str] = context.recovery_data or {}
        if context.recovered_from == "ledger_written":  # died after everything but the reply
            return _payment(await ledger.get_payment(uuid.UUID(saved["paymentId"])))
        provider_ref = saved.get("providerRef")
        if provider_ref is None or not await ledger.provider_has_charge(provider_ref):
            provider_ref = provider_ref or f"prv_{uuid.uuid4().hex}"
            await checkpoint(request, "provider_charge_sent", {"providerRef": provider_ref})
            await ledger.provider_charge(
                provider_ref=provider_ref,
                merchant_reference=body.merchant_reference,
                amount=body.amount,
                currency=body.currency,
                pod=pod,
            )
        if x_demo_delay_after_provider_ms:
            await demo_delay(body.merchant_reference, x_demo_delay_after_provider_ms)
        row = await insert_payment(ledger, body)
        await checkpoint(
            request, "ledger_written", {"providerRef": provider_ref, "paymentId": str(row["id"])}
        )
        return _payment(row)

    @app.get("/provider/charges")
    async def provider_charges(
        request: Request,
        merchant_reference: Annotated[str, Query(alias="merchantReference", pattern=NO_NUL)],
    ) -> list[dict[str, str]]:
        """What the fake provider charged for a merchant reference (one row per charge)."""
        rows = await ledger_of(request).list_provider_charges(merchant_reference)
        return [{"providerRef": row["provider_ref"], "pod": row["pod"]} for row in rows]

    @app.get("/outbox", response_model=list[OutboxEvent])
    async def list_outbox(
        request: Request,
        merchant_reference: Annotated[str, Query(alias="merchantReference", pattern=NO_NUL)],
    ) -> list[OutboxEvent]:
        """The outbox events of a merchant reference's payments, oldest first."""
        rows = await ledger_of(request).outbox_events(merchant_reference)
        return [_outbox_event(row) for row in rows]

    @app.get("/payments", response_model=list[Payment])
    async def list_payments(
        request: Request,
        merchant_reference: Annotated[
            str | None, Query(alias="merchantReference", pattern=NO_NUL)
        ] = None,
        prefix: Annotated[
            str | None, Query(alias="merchantReferencePrefix", pattern=NO_NUL)
        ] = None,
    ) -> list[Payment]:
        rows = await ledger_of(request).list_payments(
            merchant_reference=merchant_reference, reference_prefix=prefix
        )
        return [_payment(row) for row in rows]

    @app.get("/demo/delayed")
    async def demo_delayed() -> dict[str, Any]:
        """Merchant references whose payment is waiting on ``X-Demo-Delay-Ms`` on this pod."""
        return {"pod": pod, "merchantReferences": sorted(delayed)}

    @app.post(
        "/members",
        response_model=Member,
        responses=_documented(409, "The e-mail is taken: fix it and retry with the same key."),
    )
    @idempotent()
    async def create_member(body: MemberIn, request: Request) -> Member | JSONResponse:
        ledger = ledger_of(request)
        try:
            if await ledger.email_taken(body.email):
                raise DuplicateEmail(body.email)
            row = await ledger.insert_member(email=body.email, name=body.name, pod=pod)
        except DuplicateEmail:
            # Refused before anything was written: the key is released, so the client may fix
            # the e-mail and retry with the same Idempotency-Key.
            mark_retryable(request)
            return _error(
                409,
                "duplicate_email",
                "A member with this e-mail already exists; fix it and retry with the same key.",
                retryable=True,
            )
        return _member(row)

    @app.patch(
        "/members/{member_id}",
        response_model=Member,
        responses={
            **_documented(404, "No member has this id."),
            **_documented(409, "Another member has this e-mail."),
        },
    )
    @idempotent(required=False)
    async def update_member(
        member_id: uuid.UUID, body: MemberPatch, request: Request
    ) -> Member | JSONResponse:
        ledger = ledger_of(request)
        try:
            if body.email is not None and await ledger.email_taken(body.email, except_id=member_id):
                raise DuplicateEmail(body.email)
            row = await ledger.update_member(member_id, email=body.email, name=body.name, pod=pod)
        except DuplicateEmail:
            mark_retryable(request)
            return _error(409, "duplicate_email", "Another member has this e-mail.", retryable=True)
        if row is None:
            return _error(404, "member_not_found", f"No member {member_id}.")
        return _member(row)

    @app.post("/orders/submit", response_model=Order)
    @idempotent(exclude_fields=["clientTimestamp", "requestNonce"])
    async def submit_order(body: OrderIn, request: Request) -> Order:
        row = await ledger_of(request).insert_order(
            order_reference=body.order_reference,
            account_id=body.account_id,
            items=[item.model_dump(by_alias=True) for item in body.items],
            pod=pod,
        )
        return _order(row)

    @app.get("/orders", response_model=list[Order])
    async def list_orders(
        request: Request,
        order_reference: Annotated[
            str | None, Query(alias="orderReference", pattern=NO_NUL)
        ] = None,
        prefix: Annotated[str | None, Query(alias="orderReferencePrefix", pattern=NO_NUL)] = None,
    ) -> list[Order]:
        rows = await ledger_of(request).list_orders(
            order_reference=order_reference, reference_prefix=prefix
        )
        return [_order(row) for row in rows]

    # A registry per app: tests build several apps in one process.
    registry = CollectorRegistry()
    # Under `uvicorn --workers N` with PROMETHEUS_MULTIPROC_DIR set: every worker's sum.
    app.mount("/metrics", metrics_app(registry))
    app.add_middleware(
        IdempotencyMiddleware,
        store=store,
        pod_id=pod,
        key_scope=_key_scope,
        metrics=PrometheusMetrics(registry=registry),
    )
    return app
