"""``starlette-idempotency``: the PostgreSQL chores that run outside the app.

``migrate`` creates the table and its index (at deploy time; safe to repeat) and ``purge``
deletes expired rows (from cron; expired rows are already ignored, this only frees space)::

    starlette-idempotency migrate --dsn postgresql://app@db/app
    DATABASE_URL=postgresql://app@db/app starlette-idempotency purge --batch-size 5000

Exit status: 0 on success, 1 when the database fails or cannot be reached, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from starlette_idempotency.errors import ConfigurationError, StoreError
from starlette_idempotency.stores.postgres import (
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_TABLE,
    PostgresStore,
)

PROG = "starlette-idempotency"
_DESCRIPTION = "Create the PostgreSQL idempotency table, or purge its expired rows."


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dsn",
        default=os.environ.get("DATABASE_URL"),
        help="PostgreSQL connection URL (default: $DATABASE_URL)",
    )
    common.add_argument(
        "--table", default=DEFAULT_TABLE, help=f"table name, may be schema.table ({DEFAULT_TABLE})"
    )
    common.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_OPERATION_TIMEOUT,
        help=f"seconds to wait for the connection and each statement ({DEFAULT_OPERATION_TIMEOUT})",
    )
    commands.add_parser(
        "migrate", parents=[common], help="create the table and its index if missing"
    )
    purge = commands.add_parser("purge", parents=[common], help="delete expired rows")
    purge.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1000,
        help="rows deleted per statement (1000)",
    )
    return parser


async def _run(args: argparse.Namespace) -> str:
    store = await PostgresStore.connect(
        args.dsn, table=args.table, operation_timeout=args.timeout, min_size=1, max_size=1
    )
    async with store:
        if args.command == "migrate":
            if await store.create_schema():
                return f"migrate: created table {args.table} and its expires_at index"
            return f"migrate: table {args.table} already exists; its index is in place"
        deleted = await store.purge_expired(batch_size=args.batch_size)
        return f"purge: deleted {deleted} expired row(s) from {args.table}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("no database given: pass --dsn or set DATABASE_URL")
    try:
        message = asyncio.run(_run(args))
    except ConfigurationError as exc:
        parser.error(" ".join(str(exc).split()))
    except StoreError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
