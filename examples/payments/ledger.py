"""The demo's ledger: payments, their outbox, members and orders in PostgreSQL, through asyncpg.

The ``payments``, ``outbox`` and ``orders`` tables have no unique constraint on the merchant or
order reference, nor on anything derived from the idempotency key, on purpose: a request that
ran twice leaves a second row for everyone to see. Only ``members.email`` is unique, because a
duplicate e-mail is the demo's retryable business failure, and the fake provider's
``idempotency_key``, because a provider with idempotency keys keeps one charge per key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any, cast

import asyncpg  # type: ignore[import-untyped]

# Two pods run this at the same moment on startup; the advisory lock keeps concurrent
# CREATE ... IF NOT EXISTS statements from tripping over each other in the catalog.
_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(hashtext('payments-demo-schema'))"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS payments (
    id uuid PRIMARY KEY,
    account_id text NOT NULL,
    amount numeric(18, 2) NOT NULL,
    currency text NOT NULL,
    merchant_reference text NOT NULL,
    pod text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS payments_merchant_reference_idx
    ON payments (merchant_reference);

-- Events for other services, written in the transaction of the rows they announce (a relay
-- would publish them; the demo only writes them).
CREATE TABLE IF NOT EXISTS outbox (
    id bigserial PRIMARY KEY,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS members (
    id uuid PRIMARY KEY,
    email text NOT NULL,
    name text NOT NULL,
    pod text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX IF NOT EXISTS members_email_idx ON members (lower(email));

CREATE TABLE IF NOT EXISTS orders (
    id uuid PRIMARY KEY,
    order_reference text NOT NULL,
    account_id text NOT NULL,
    items jsonb NOT NULL,
    pod text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS orders_order_reference_idx ON orders (order_reference);

-- The fake payment provider's side: one row per charge it made. A charge call without an
-- idempotency key always charges (so that a handler charging twice shows as two rows); a call
-- with one charges once per key, and a second call gets that first charge back.
CREATE TABLE IF NOT EXISTS provider_charges (
    provider_ref text NOT NULL,
    merchant_reference text NOT NULL,
    amount numeric(18, 2) NOT NULL,
    currency text NOT NULL,
    pod text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS provider_charges_ref_idx ON provider_charges (provider_ref);
CREATE INDEX IF NOT EXISTS provider_charges_merchant_idx ON provider_charges (merchant_reference);
ALTER TABLE provider_charges ADD COLUMN IF NOT EXISTS idempotency_key text;
CREATE UNIQUE INDEX IF NOT EXISTS provider_charges_idempotency_key_idx
    ON provider_charges (idempotency_key);
"""

_PAYMENT_COLUMNS = "id, account_id, amount, currency, merchant_reference, pod, created_at"
_MEMBER_COLUMNS = "id, email, name, pod, created_at, updated_at"
_ORDER_COLUMNS = "id, order_reference, account_id, items, pod, created_at"
_LIST_LIMIT = 10_000

Row = Mapping[str, Any]


class DuplicateEmail(Exception):
    """Another member already has this e-mail address."""


class Ledger:
    """The demo's business data, on an asyncpg pool this object opens and closes."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, dsn: str, *, max_size: int = 10) -> Ledger:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=max_size, timeout=10)
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def create_schema(self) -> None:
        async with self._pool.acquire() as connection, connection.transaction():
            await connection.execute(_SCHEMA_LOCK)
            await connection.execute(_SCHEMA)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """One of the pool's connections, for statements that commit together."""
        async with self._pool.acquire() as connection:
            yield connection

    async def ping(self) -> bool:
        return bool(await self._pool.fetchval("SELECT true", timeout=2))

    async def insert_payment(
        self,
        *,
        account_id: str,
        amount: Decimal,
        currency: str,
        merchant_reference: str,
        pod: str,
        connection: Any = None,
    ) -> Row:
        """Insert a payment, on ``connection`` (in its transaction) or on the pool."""
        row = await (connection or self._pool).fetchrow(
            "INSERT INTO payments (id, account_id, amount, currency, merchant_reference, pod) "
            f"VALUES ($1, $2, $3, $4, $5, $6) RETURNING {_PAYMENT_COLUMNS}",
            uuid.uuid4(),
            account_id,
            amount,
            currency,
            merchant_reference,
            pod,
        )
        return cast(Row, row)

    async def add_outbox_event(
        self, connection: Any, event_type: str, payload: Mapping[str, Any]
    ) -> None:
        """Write an event on ``connection``: it commits with the rows it announces, or not at
        all."""
        await connection.execute(
            "INSERT INTO outbox (event_type, payload) VALUES ($1, $2::jsonb)",
            event_type,
            json.dumps(payload),
        )

    async def outbox_events(self, merchant_reference: str) -> Sequence[Row]:
        """The events whose payload names this merchant reference, oldest first."""
        rows = await self._pool.fetch(
            "SELECT id, event_type, payload, created_at FROM outbox "
            f"WHERE payload ->> 'merchantReference' = $1 ORDER BY id LIMIT {_LIST_LIMIT}",
            merchant_reference,
        )
        return cast(Sequence[Row], rows)

    async def get_payment(self, payment_id: uuid.UUID) -> Row:
        row = await self._pool.fetchrow(
            f"SELECT {_PAYMENT_COLUMNS} FROM payments WHERE id = $1", payment_id
        )
        return cast(Row, row)

    async def provider_charge(
        self,
        *,
        provider_ref: str,
        merchant_reference: str,
        amount: Decimal,
        currency: str,
        pod: str,
    ) -> None:
        """The fake provider takes a charge (every call is a charge)."""
        await self._pool.execute(
            "INSERT INTO provider_charges "
            "(provider_ref, merchant_reference, amount, currency, pod) VALUES ($1, $2, $3, $4, $5)",
            provider_ref,
            merchant_reference,
            amount,
            currency,
            pod,
        )

    async def provider_charge_once(
        self,
        *,
        idempotency_key: str,
        merchant_reference: str,
        amount: Decimal,
        currency: str,
        pod: str,
    ) -> str:
        """The fake provider's charge with an idempotency key: the first call charges, and any
        later call with the key is dropped and answered with that first charge's reference."""
        charged = await self._pool.fetchval(
            "INSERT INTO provider_charges "
            "(provider_ref, idempotency_key, merchant_reference, amount, currency, pod) "
            "VALUES ($1, $2, $3, $4, $5, $6) "
            "ON CONFLICT (idempotency_key) DO NOTHING RETURNING provider_ref",
            f"prv_{uuid.uuid4().hex}",
            idempotency_key,
            merchant_reference,
            amount,
            currency,
            pod,
        )
        if charged is not None:
            return str(charged)
        # A new statement, so it sees the first call's row even if it committed meanwhile.
        first = await self._pool.fetchval(
            "SELECT provider_ref FROM provider_charges WHERE idempotency_key = $1",
            idempotency_key,
        )
        return str(first)

    async def provider_has_charge(self, provider_ref: str) -> bool:
        """The fake provider's lookup by its own idempotency reference."""
        return bool(
            await self._pool.fetchval(
                "SELECT EXISTS (SELECT 1 FROM provider_charges WHERE provider_ref = $1)",
                provider_ref,
            )
        )

    async def list_provider_charges(self, merchant_reference: str) -> Sequence[Row]:
        rows = await self._pool.fetch(
            "SELECT provider_ref, merchant_reference, amount, currency, pod, created_at "
            "FROM provider_charges WHERE merchant_reference = $1 ORDER BY created_at",
            merchant_reference,
        )
        return cast(Sequence[Row], rows)

    async def list_payments(
        self, *, merchant_reference: str | None = None, reference_prefix: str | None = None
    ) -> Sequence[Row]:
        """Payments with this reference, or whose reference starts with the prefix."""
        where, argument = _filter("merchant_reference", merchant_reference, reference_prefix)
        rows = await self._pool.fetch(
            f"SELECT {_PAYMENT_COLUMNS} FROM payments {where} "
            f"ORDER BY created_at, id LIMIT {_LIST_LIMIT}",
            *argument,
        )
        return cast(Sequence[Row], rows)

    async def email_taken(self, email: str, *, except_id: uuid.UUID | None = None) -> bool:
        taken = await self._pool.fetchval(
            "SELECT EXISTS (SELECT 1 FROM members WHERE lower(email) = lower($1) "
            "AND id IS DISTINCT FROM $2)",
            email,
            except_id,
        )
        return bool(taken)

    async def insert_member(self, *, email: str, name: str, pod: str) -> Row:
        try:
            row = await self._pool.fetchrow(
                f"INSERT INTO members (id, email, name, pod) VALUES ($1, $2, $3, $4) "
                f"RETURNING {_MEMBER_COLUMNS}",
                uuid.uuid4(),
                email,
                name,
                pod,
            )
        except asyncpg.UniqueViolationError as exc:
            raise DuplicateEmail(email) from exc
        return cast(Row, row)

    async def update_member(
        self, member_id: uuid.UUID, *, email: str | None, name: str | None, pod: str
    ) -> Row | None:
        try:
            row = await self._pool.fetchrow(
                "UPDATE members SET email = coalesce($2, email), name = coalesce($3, name), "
                f"pod = $4, updated_at = now() WHERE id = $1 RETURNING {_MEMBER_COLUMNS}",
                member_id,
                email,
                name,
                pod,
            )
        except asyncpg.UniqueViolationError as exc:
            raise DuplicateEmail(email or "") from exc
        return cast("Row | None", row)

    async def insert_order(
        self,
        *,
        order_reference: str,
        account_id: str,
        items: Sequence[Mapping[str, Any]],
        pod: str,
    ) -> Row:
        row = await self._pool.fetchrow(
            "INSERT INTO orders (id, order_reference, account_id, items, pod) "
            f"VALUES ($1, $2, $3, $4::jsonb, $5) RETURNING {_ORDER_COLUMNS}",
            uuid.uuid4(),
            order_reference,
            account_id,
            json.dumps(list(items)),
            pod,
        )
        return cast(Row, row)

    async def list_orders(
        self, *, order_reference: str | None = None, reference_prefix: str | None = None
    ) -> Sequence[Row]:
        where, argument = _filter("order_reference", order_reference, reference_prefix)
        rows = await self._pool.fetch(
            f"SELECT {_ORDER_COLUMNS} FROM orders {where} "
            f"ORDER BY created_at, id LIMIT {_LIST_LIMIT}",
            *argument,
        )
        return cast(Sequence[Row], rows)


def _filter(column: str, exact: str | None, prefix: str | None) -> tuple[str, tuple[str, ...]]:
    if exact is not None:
        return f"WHERE {column} = $1", (exact,)
    if prefix is not None:
        return f"WHERE starts_with({column}, $1)", (prefix,)
    return "", ()


def decode_items(value: Any) -> list[dict[str, Any]]:
    """asyncpg returns ``jsonb`` as text unless a codec is set."""
    decoded = json.loads(value) if isinstance(value, str) else value
    return cast(list[dict[str, Any]], decoded)


def iso(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")
