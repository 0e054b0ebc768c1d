"""The demo's ledger: payments, members and orders in PostgreSQL, through asyncpg.

The ``payments`` and ``orders`` tables have no unique constraint on the merchant or order
reference, nor on anything derived from the idempotency key, on purpose: a request that ran
twice leaves a second row for everyone to see. Only ``members.email`` is unique, because a
duplicate e-mail is the demo's retryable business failure.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
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

-- The fake payment provider's side: one row per charge call it received, on purpose without a
-- unique constraint, so that a handler charging twice shows as two rows.
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
    ) -> Row:
        row = await self._pool.fetchrow(
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
