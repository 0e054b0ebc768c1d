"""``starlette-idempotency``: the store chores that run outside the app.

``migrate`` creates the PostgreSQL table and its index (at deploy time; safe to repeat; with
``--sql`` it prints the DDL instead, for a migration tool and without connecting),
``purge`` deletes expired rows (from cron; expired rows are already ignored, this only frees
space), ``doctor`` runs the store check the middleware runs at startup, from a shell,
``show``, ``delete``, ``resolve`` and ``list`` are for on call (see :mod:`._cli_keys`), and
``monitoring`` writes out the Grafana dashboard and the Prometheus alerting rules this version
ships::

    starlette-idempotency migrate --dsn postgresql://app@db/app
    starlette-idempotency migrate --sql --table billing.idempotency_keys > V7__idempotency.sql
    DATABASE_URL=postgresql://app@db/app starlette-idempotency purge --batch-size 5000
    starlette-idempotency doctor --redis redis://cache:6379/0
    starlette-idempotency doctor --dsn postgresql://app@db/app --strict
    starlette-idempotency list --stuck --redis redis://cache:6379/0
    starlette-idempotency monitoring --write /etc/prometheus/idempotency

``doctor`` prints one line per finding (``error:`` or ``warning:``, with what to change) and a
summary line. Exit status: 0 on success (for ``doctor``: no errors; warnings too fail with
``--strict``), 1 when the store fails, cannot be reached or has errors, a needed extra is
not installed, or a key command finds no record or refuses, 2 on bad usage. Messages name
hosts and databases, never passwords.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette_idempotency import __version__
from starlette_idempotency._cli_keys import (
    KEY_COMMANDS,
    CommandFailed,
    add_key_commands,
    run_key_command,
    utf8_text,
)
from starlette_idempotency._store_check import check_store
from starlette_idempotency.errors import ConfigurationError, StoreError
from starlette_idempotency.stores.base import DEFAULT_KEY_PREFIX, CheckableStore, StoreFinding
from starlette_idempotency.stores.postgres import (
    DEFAULT_OPERATION_TIMEOUT,
    DEFAULT_TABLE,
    PostgresStore,
    schema_sql,
)

if TYPE_CHECKING:
    from starlette_idempotency.stores.redis import RedisStore
    from starlette_idempotency.stores.redis._store import DriverName

PROG = "starlette-idempotency"
_DESCRIPTION = (
    "Create the PostgreSQL idempotency table, purge its expired rows, check a Redis or "
    "PostgreSQL store as the middleware does at startup, show, delete, resolve and list its "
    "keys, or write out the monitoring kit."
)
# SQLSTATE undefined_table: purge (or anything else) before migrate.
_UNDEFINED_TABLE = "42P01"
# The extra that installs each driver, for an ImportError that does not name it.
_DRIVER_EXTRAS = {"asyncpg": "postgres", "redis": "redis", "glide": "glide"}


class _Failed(Exception):
    """A command failed in a way worth one line on stderr (exit status 1)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    database = argparse.ArgumentParser(add_help=False)
    database.add_argument("--dsn", help="PostgreSQL connection URL (default: $DATABASE_URL)")
    database.add_argument(
        "--table", default=DEFAULT_TABLE, help=f"table name, may be schema.table ({DEFAULT_TABLE})"
    )
    common = argparse.ArgumentParser(add_help=False, parents=[database])
    common.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_OPERATION_TIMEOUT,
        help=f"seconds to wait for the connection and each statement ({DEFAULT_OPERATION_TIMEOUT})",
    )
    migrate = commands.add_parser(
        "migrate", parents=[common], help="create the table and its index if missing"
    )
    migrate.add_argument(
        "--sql",
        action="store_true",
        help="print the DDL instead of running it (for Alembic, Flyway or a DBA's review); "
        "connects to nothing",
    )
    purge = commands.add_parser("purge", parents=[common], help="delete expired rows")
    purge.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1000,
        help="rows deleted per statement (1000)",
    )
    store = argparse.ArgumentParser(add_help=False, parents=[database])
    store.add_argument("--redis", metavar="URL", help="Redis URL (redis://, rediss:// or unix://)")
    store.add_argument(
        "--key-prefix",
        default=DEFAULT_KEY_PREFIX,
        type=utf8_text(),
        help=f"the store's key prefix ({DEFAULT_KEY_PREFIX})",
    )
    doctor = commands.add_parser(
        "doctor",
        parents=[store],
        help="check a Redis or PostgreSQL store as the middleware does at startup",
        description="Reach the store and report what would break it (errors) or weaken its "
        "guarantees (warnings), with what to change. Exit status 0 without errors, 1 with "
        "errors (or warnings, with --strict), 2 on bad usage.",
    )
    doctor.add_argument(
        "--driver",
        choices=("redis-py", "glide"),
        default="redis-py",
        help="the Redis client library the app uses (redis-py)",
    )
    doctor.add_argument("--strict", action="store_true", help="exit with status 1 on warnings too")
    monitoring = commands.add_parser(
        "monitoring",
        help="list or write out the Grafana dashboard and the Prometheus alerting rules",
        description="Without --write, print where the installed package keeps the monitoring "
        "kit and its files; with --write, copy them into DIR (created if missing).",
    )
    monitoring.add_argument("--write", metavar="DIR", type=Path, help="copy the files into DIR")
    monitoring.add_argument(
        "--force", action="store_true", help="overwrite files in DIR that differ"
    )
    add_key_commands(commands, store)
    return parser


def _monitoring(args: argparse.Namespace) -> str:
    """``monitoring``: the lines to print (the kit's files, or those written)."""
    kit = resources.files("starlette_idempotency") / "monitoring"
    files = sorted((item for item in kit.iterdir() if item.is_file()), key=lambda i: i.name)
    if args.write is None:
        return "\n".join([f"monitoring: {kit}", *(f"  {item.name}" for item in files)])
    targets = [(item.read_bytes(), args.write / item.name) for item in files]
    differing = [
        str(target)
        for content, target in targets
        if target.exists() and target.read_bytes() != content
    ]
    if differing and not args.force:
        raise _Failed(f"{', '.join(differing)}: exists with other content; --force overwrites")
    args.write.mkdir(parents=True, exist_ok=True)
    for content, target in targets:
        target.write_bytes(content)
    return "\n".join(f"monitoring: wrote {target}" for _, target in targets)


async def _chore(args: argparse.Namespace) -> str:
    """``migrate`` or ``purge``: the line to print on success."""
    store = await PostgresStore.connect(
        args.dsn, table=args.table, operation_timeout=args.timeout, min_size=1, max_size=1
    )
    async with store:
        if args.command == "migrate":
            if await store.create_schema():
                return f"migrate: created table {args.table} and its expires_at index"
            return f"migrate: table {args.table} already exists; its index is in place"
        try:
            deleted = await store.purge_expired(batch_size=args.batch_size)
        except StoreError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != _UNDEFINED_TABLE:
                raise
            raise _Failed(f"{store.describe()} does not exist: {_migrate_hint(args)}") from exc
        return f"purge: deleted {deleted} expired row(s) from {args.table}"


def _ddl(table: str) -> str:
    """``migrate --sql``: the statements ``migrate`` runs, under a line naming their source."""
    return f"-- {PROG} {__version__}: migrate --table {table}\n{schema_sql(table)}"


def _migrate_hint(args: argparse.Namespace) -> str:
    """What to run first, without the DSN (it may hold a password): where it came from."""
    table = "" if args.table == DEFAULT_TABLE else f" --table {args.table}"
    source = "--dsn" if args.dsn_given else "DATABASE_URL"
    return f"run `{PROG} migrate{table}` with the same {source} first"


async def _store_for(args: argparse.Namespace) -> RedisStore | PostgresStore:
    """The store ``--redis`` or ``--dsn`` (and ``--table``, ``--key-prefix``) describe."""
    if args.redis:
        from starlette_idempotency.stores.redis import RedisStore

        # The key commands list keys with SCAN, which only the redis-py driver sends.
        driver: DriverName = getattr(args, "driver", "redis-py")
        try:
            # No middleware bounds the CLI's calls: redis-py's socket timeout does.
            options: dict[str, Any] = {}
            if driver == "redis-py":
                options["socket_timeout"] = DEFAULT_OPERATION_TIMEOUT
            return RedisStore.from_url(
                args.redis, key_prefix=args.key_prefix, driver=driver, **options
            )
        except ValueError as exc:  # redis-py refusing the URL (no password in its message)
            raise ConfigurationError(f"--redis: {exc}") from exc
    # min_size=0: the first connection is the first operation's, so an unreachable database
    # is reported by it (for doctor, in the words the middleware logs), rather than raised here.
    return await PostgresStore.connect(
        args.dsn, table=args.table, key_prefix=args.key_prefix, min_size=0, max_size=1
    )


async def _key_command(args: argparse.Namespace) -> str:
    store = await _store_for(args)
    try:
        return await run_key_command(store, args)
    finally:
        await store.aclose()


async def _doctor(args: argparse.Namespace) -> list[StoreFinding]:
    """The store check the middleware runs at startup, on the store ``args`` describe."""
    store = await _store_for(args)
    try:
        if not isinstance(store, CheckableStore):
            raise _Failed(f"{type(store).__name__} cannot check itself in this version")
        print(f"doctor: checking {store.describe()}", flush=True)
        return await check_store(store)
    finally:
        await store.aclose()


def _summary(findings: list[StoreFinding], strict: bool) -> tuple[str, int]:
    errors = sum(finding.level == "error" for finding in findings)
    warnings = len(findings) - errors
    counts = f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"
    if errors:
        return f"doctor: {counts}: fix the errors before the app uses this store", 1
    if warnings and strict:
        return f"doctor: {counts}: failing on warnings (--strict)", 1
    if warnings:
        return f"doctor: {counts}: the store works, with the weaker guarantees above", 0
    return f"doctor: {counts}: ok", 0


def _missing_extra(exc: ImportError) -> str | None:
    """One line for an optional dependency that is not installed, naming the extra; ``None``
    when ``exc`` is something else (a broken install is worth its traceback)."""
    message = _one_line(exc)
    if "starlette-idempotency[" in message:  # the package's own import guards name it
        return message
    extra = _DRIVER_EXTRAS.get((exc.name or "").partition(".")[0])
    if extra is None:
        return None
    return f"{message}: pip install 'starlette-idempotency[{extra}]'"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "monitoring":
        try:
            print(_monitoring(args))
        except (_Failed, OSError) as exc:
            return _fail(_one_line(exc))
        return 0
    args.dsn_given = bool(args.dsn)
    on_redis = bool(getattr(args, "redis", None))
    if on_redis and args.dsn:
        parser.error("pass --redis or --dsn, not both")
    if on_redis and args.table != DEFAULT_TABLE:
        parser.error("--table is for a PostgreSQL store (--dsn)")
    if args.command == "migrate" and args.sql:
        if args.dsn:
            parser.error("--sql prints the DDL without connecting: drop --dsn")
        try:
            print(_ddl(args.table), end="")
        except ConfigurationError as exc:
            parser.error(_one_line(exc))
        return 0
    if not on_redis:
        args.dsn = args.dsn or os.environ.get("DATABASE_URL")
        if not args.dsn:
            what = "--redis URL or --dsn" if hasattr(args, "redis") else "--dsn"
            parser.error(f"no store given: pass {what} or set DATABASE_URL")
    try:
        if args.command in KEY_COMMANDS:
            print(asyncio.run(_key_command(args)))
            return 0
        if args.command != "doctor":
            print(asyncio.run(_chore(args)))
            return 0
        findings = asyncio.run(_doctor(args))
    except ConfigurationError as exc:
        parser.error(_one_line(exc))
    except ImportError as exc:
        message = _missing_extra(exc)
        if message is None:
            raise
        return _fail(message)
    except (StoreError, _Failed, CommandFailed) as exc:
        return _fail(_one_line(exc))
    for finding in findings:
        print(f"{finding.level}: {_one_line(finding.message)}")
    summary, status = _summary(findings, args.strict)
    print(summary)
    return status


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
