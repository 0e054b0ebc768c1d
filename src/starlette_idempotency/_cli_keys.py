"""``starlette-idempotency show | delete | resolve | list``: one key, or the keys in progress,
from an on-call shell.

A key is addressed as the middleware stores it (:func:`storage_key`): its scope (the
``key_scope`` answer, empty without one), the method, the route's path template and the key
the client sent. ``show`` prints the record (its body only with ``--body``, opened with the
app's encryption keys when it is sealed), ``delete`` frees the key (the next retry runs the
handler again), ``resolve`` finishes a record whose handler died (the response every retry
then gets) and ``list`` shows the records in progress (``--stuck``: those whose lease ran out,
held for recovery). ``--json`` prints one JSON document instead of lines.

A lease is judged on the store's clock by ``list``, and on this machine's clock by ``show``,
``delete`` and ``resolve`` (seconds apart at most, on hosts that keep time).
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from starlette_idempotency._kept_response import SEALED_HEADER, ResponseEncryption, never_stored
from starlette_idempotency._keys import split_storage_key, storage_key
from starlette_idempotency._record import (
    IdempotencyRecord,
    RecordStatus,
    StoredResponse,
    record_to_dict,
)
from starlette_idempotency._types import (
    REPLAY_HEADER,
    STRIPE_REPLAY_HEADER,
    checked_header_name,
)
from starlette_idempotency.errors import ConfigurationError
from starlette_idempotency.stores.base import (
    DEFAULT_RESOLVED_TTL,
    RESOLVED_TTL_RANGE,
    HeldRecord,
)

if TYPE_CHECKING:
    from starlette_idempotency.stores.postgres import PostgresStore
    from starlette_idempotency.stores.redis import RedisStore

KEY_COMMANDS = frozenset({"show", "delete", "resolve", "list"})
#: What ``resolve --header`` takes: a field name (RFC 9110's token) and a value HTTP servers
#: send as they are (Latin-1, no control characters).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
#: Statuses whose answer has no content (RFC 9110, 15.3.5, 15.3.6 and 15.4.5); 204 and 304 are
#: sent without a Content-Length too, 205 with ``Content-Length: 0``.
_NO_CONTENT_STATUSES = frozenset({204, 205, 304})
_NO_LENGTH_STATUSES = frozenset({204, 304})
#: The replay headers of the two usual names; the app's own (``--replay-header-name``) is
#: refused beside them. Added to every replay: stored too, a replay would carry them twice.
_REPLAY_HEADERS = frozenset({REPLAY_HEADER.lower(), STRIPE_REPLAY_HEADER.lower()})
_LIST_LIMIT = 1000


class CommandFailed(Exception):
    """The key command could not do what was asked (exit status 1, one line on stderr)."""


def add_key_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], store: argparse.ArgumentParser
) -> None:
    """The key commands, on the store options ``store`` declares (``--redis`` or ``--dsn``)."""
    output = argparse.ArgumentParser(add_help=False, parents=[store])
    output.add_argument("--json", action="store_true", help="print one JSON document")
    keys = argparse.ArgumentParser(add_help=False)
    keys.add_argument(
        "--encryption-key",
        action="append",
        default=[],
        metavar="KEY_ID=ENV_VAR",
        help="a key of the app's ResponseEncryption: its id, and the environment variable that "
        "holds it (never the key itself on the command line); repeat for each key, the first "
        "seals what resolve stores",
    )
    one = argparse.ArgumentParser(add_help=False, parents=[output, keys])
    one.add_argument(
        "key", metavar="KEY", type=utf8_text(), help="the Idempotency-Key the client sent"
    )
    one.add_argument(
        "--route",
        required=True,
        type=utf8_text(),
        metavar="TEMPLATE",
        help="the route's path template, as the app declares it (/payments/{payment_id}), or "
        "for a route given operation=, that name (payments.create); under a Host route, the "
        "host it matched followed directly by either, nothing between them "
        "(api.example.com/payments, api.example.compayments.create)",
    )
    one.add_argument(
        "--method", default="POST", type=utf8_text(), help="the request's method (POST)"
    )
    one.add_argument(
        "--scope",
        default="",
        type=utf8_text(),
        help="the key scope: key_scope's answer for the client (none)",
    )
    force = argparse.ArgumentParser(add_help=False)
    force.add_argument(
        "--force",
        action="store_true",
        help="act on a record in progress whose handler may still be running",
    )

    show = commands.add_parser(
        "show", parents=[one], help="print one key's record: state, lease, recovery points"
    )
    show.add_argument(
        "--body", action="store_true", help="print the stored body too (decrypted when sealed)"
    )
    commands.add_parser(
        "delete",
        parents=[one, force],
        help="delete one key's record: the next retry runs the handler again",
    )
    resolve = commands.add_parser(
        "resolve",
        parents=[one, force],
        help="finish a record in progress (held for recovery) with the response retries get",
    )
    resolve.add_argument(
        "--status", type=int, required=True, help="the status code (below 400: Completed)"
    )
    resolve.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a response header; repeat for more (a replay header is refused: see "
        "--replay-header-name)",
    )
    resolve.add_argument(
        "--replay-header-name",
        default=REPLAY_HEADER,
        metavar="NAME",
        help="the app's replay_header_name, which every replay adds, so --header refuses it "
        f"(as it refuses {REPLAY_HEADER} and {STRIPE_REPLAY_HEADER}) ({REPLAY_HEADER})",
    )
    body = resolve.add_mutually_exclusive_group()
    body.add_argument(
        "--body",
        type=utf8_text("; pass a body of other bytes with --body-file"),
        help="the response body, as UTF-8 text (refused otherwise: pass other bytes with "
        "--body-file)",
    )
    body.add_argument(
        "--body-file",
        type=Path,
        metavar="PATH",
        help="the response body, read from a file as it is (- for standard input)",
    )
    resolve.add_argument(
        "--content-type",
        default="application/json",
        help="without a content-type --header, for a body (application/json)",
    )
    resolve.add_argument(
        "--ttl-hours",
        type=_within(float, RESOLVED_TTL_RANGE[0] / 3600, RESOLVED_TTL_RANGE[1] / 3600),
        default=DEFAULT_RESOLVED_TTL / 3600,
        help=f"how long retries get the response ({DEFAULT_RESOLVED_TTL / 3600:g})",
    )
    listing = commands.add_parser(
        "list", parents=[output], help="list the records in progress, oldest first"
    )
    listing.add_argument(
        "--stuck",
        action="store_true",
        help="only those whose lease ran out: a dead handler's record, held for recovery",
    )
    listing.add_argument(
        "--limit",
        type=_within(int, 1),
        default=_LIST_LIMIT,
        help=f"at most this many ({_LIST_LIMIT})",
    )


def utf8_text(hint: str = "") -> Callable[[str], str]:
    """An argparse ``type``: the text as given, refused unless it is UTF-8 (with ``hint``
    after the refusal). A command line's bytes that are not UTF-8 reach Python as lone
    surrogates, which no store and no response can encode."""

    def parse(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = ord(text[exc.start])
            # A byte the shell passed comes as U+DC80 to U+DCFF (surrogateescape).
            what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
            offset = len(text[: exc.start].encode("utf-8"))
            raise argparse.ArgumentTypeError(
                f"not UTF-8 text ({what} at offset {offset}): check the terminal's encoding and "
                f"the quoting{hint}"
            ) from None
        return text

    parse.__name__ = "text"
    return parse


def _within(
    kind: Callable[[str], float], lowest: float, highest: float = sys.float_info.max
) -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)``, refused unless from ``lowest`` to ``highest``."""

    def parse(text: str) -> float:
        value = kind(text)
        if not lowest <= value <= highest:
            limit = "" if highest == sys.float_info.max else f" to {highest:g}"
            raise argparse.ArgumentTypeError(f"must be {lowest:g}{limit}, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ..." message
    return parse


async def run_key_command(store: RedisStore | PostgresStore, args: argparse.Namespace) -> str:
    """What the command prints; raises :class:`CommandFailed` when it cannot do it."""
    if args.command == "list":
        held = await store.in_progress(stuck=args.stuck, limit=args.limit)
        return _list_output(held, stuck=args.stuck, as_json=args.json)
    encryption = _encryption(args.encryption_key)
    key = storage_key(args.scope, args.method.upper(), args.route, args.key)
    if args.command == "resolve":
        response = _response(args)  # bad options are refused before the store is read
        record = await _stopped_record(store, key, force=args.force)
        if record.status is not RecordStatus.IN_PROGRESS:
            raise CommandFailed(
                f"{key!r} is already {record.status.value}: retries get its response; "
                "delete it to let the next retry run the handler again"
            )
        if encryption is not None:
            response = encryption.encrypt(response, key)
        ttl = args.ttl_hours * 3600
        # Without --force, only the record looked at, and only while its handler has stopped.
        checked = None if args.force else record.owner_token
        if not await store.resolve(key, response, ttl, owner_token=checked):
            raise CommandFailed(
                f"{key!r} changed hands meanwhile, or its handler holds it again (a retry took "
                "it over, its lease was renewed, or it was deleted or expired): show it again"
            )
        finished = RecordStatus.COMPLETED if response.status_code < 400 else RecordStatus.FAILED
        return _done("resolved", key, finished, as_json=args.json)
    if args.command == "show":
        record = await _record(store, key)
        return _show(key, record, encryption, body=args.body, as_json=args.json)
    record = await _stopped_record(store, key, force=args.force)
    if not await store.delete(key, owner_token=None if args.force else record.owner_token):
        raise CommandFailed(
            f"{key!r} changed hands meanwhile, or its handler holds it again (a retry took it "
            "over, or its transaction is writing its outcome): show it again"
        )
    return _done("deleted", key, record.status, as_json=args.json)


async def _record(store: RedisStore | PostgresStore, key: str) -> IdempotencyRecord:
    record = await store.get(key)
    if record is None:
        raise CommandFailed(
            f"no record under {key!r} in {store.describe()}: check --key-prefix, --scope, "
            "--method and --route (the template, or the operation= name; under a Host route "
            "the host it matched followed directly by either: api.example.com/payments, "
            "api.example.compayments.create). `list` prints the routes of the records in "
            "progress"
        )
    return record


async def _stopped_record(
    store: RedisStore | PostgresStore, key: str, *, force: bool
) -> IdempotencyRecord:
    """The record under ``key``, unless its handler may still be running (and not ``force``)."""
    record = await _record(store, key)
    if record.status is RecordStatus.IN_PROGRESS and not force and _may_run(record):
        raise CommandFailed(
            f"{key!r} is in progress and its handler may still be running "
            f"({_lease_text(record)}): wait for its lease to run out, or pass --force"
        )
    return record


def _encryption(specs: list[str]) -> ResponseEncryption | None:
    """The app's keys, from the environment variables ``--encryption-key`` names."""
    if not specs:
        return None
    keys: dict[str, str] = {}
    for spec in specs:
        key_id, sep, variable = spec.partition("=")
        if not sep or not key_id or not variable:
            raise ConfigurationError(f"--encryption-key takes KEY_ID=ENV_VAR, not {spec!r}")
        value = os.environ.get(variable)
        if not value:
            raise ConfigurationError(
                f"--encryption-key {spec}: the environment variable {variable} is not set"
            )
        keys[key_id] = value
    current = specs[0].partition("=")[0]
    return ResponseEncryption(keys, current=current)


def _may_run(record: IdempotencyRecord) -> bool:
    """Whether the record's handler may still be running: a lock without recovery points, or
    a lease not yet run out (on this machine's clock)."""
    return record.locked_until is None or not record.lease_expired(time.time())


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")


def _lease_text(record: IdempotencyRecord) -> str:
    if record.status is not RecordStatus.IN_PROGRESS:
        return "none (finished)"
    if record.locked_until is None:
        return f"a lock held by its handler, ending by {_iso(record.expires_at)} unless renewed"
    state = "run out" if record.lease_expired(time.time()) else "running"
    return f"lease until {_iso(record.locked_until)} ({state})"


def _parts(key: str) -> dict[str, str | None]:
    scope_id, method, route, client_key = split_storage_key(key) or (None, None, None, None)
    return {
        "storageKey": key,
        "scope": scope_id,
        "method": method,
        "route": route,
        "key": client_key,
    }


def _show(
    key: str,
    record: IdempotencyRecord,
    encryption: ResponseEncryption | None,
    *,
    body: bool,
    as_json: bool,
) -> str:
    stored = record.response
    sealed_with = None
    if stored is not None and stored.headers and stored.headers[0][0] == SEALED_HEADER:
        sealed_with = stored.headers[0][1].partition(";key=")[2]
        opened = None if encryption is None else encryption.decrypt(stored, key)
        if opened is None and body:
            raise CommandFailed(
                f"the response of {key!r} is sealed with key {sealed_with!r}, which no "
                f"--encryption-key given opens: pass --encryption-key {sealed_with}=ENV_VAR "
                "naming the variable that holds that key"
            )
        stored = opened or stored
    shown = record if stored is record.response else replace(record, response=stored)
    view: dict[str, Any] = {**_parts(key), **record_to_dict(shown)}
    view["leaseExpired"] = record.lease_expired(time.time()) if record.locked_until else None
    view["sealedWith"] = sealed_with
    if not body:
        view.pop("responseBody")
        view.pop("responseBodyEncoding")
    if as_json:
        return orjson.dumps(view, option=orjson.OPT_INDENT_2).decode()
    lines = [
        f"storage key: {key}",
        f"status: {record.status.value}",
        f"created: {_iso(record.created_at)}",
        f"expires: {_iso(record.expires_at)}",
        f"lease: {_lease_text(record)}",
        f"recovery points: {len(record.checkpoints)}",
        *(
            f"  {point.name} at {_iso(point.at)}: {orjson.dumps(point.data).decode()}"
            for point in record.checkpoints
        ),
    ]
    if stored is not None:
        seal = f", sealed with key {sealed_with}" if sealed_with else ""
        opened_note = " (opened)" if sealed_with and stored is not record.response else ""
        lines.append(f"response: {stored.status_code}{seal}{opened_note}")
        lines += [f"  {name}: {value}" for name, value in stored.headers]
        if body:
            lines += ["body:", _body_text(stored.body)]
    return "\n".join(lines)


def _body_text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return "(base64) " + base64.b64encode(body).decode("ascii")


def _response(args: argparse.Namespace) -> StoredResponse:
    """The response ``resolve`` stores, from its options."""
    if not 200 <= args.status <= 599:
        raise ConfigurationError(
            f"--status must be a final HTTP status code (200 to 599), not {args.status}"
        )
    replay_header = checked_header_name(
        "--replay-header-name", args.replay_header_name, REPLAY_HEADER
    ).lower()
    headers: list[tuple[str, str]] = []
    for spec in args.header:
        name, sep, value = spec.partition(":")
        name, value = name.strip().lower(), value.strip()
        if not sep or not _TOKEN.fullmatch(name):
            raise ConfigurationError(
                f"--header takes 'NAME: VALUE' with a name of letters, digits and !#$%&'*+-.^_`|~"
                f", not {spec!r}"
            )
        _check_field_value(f"--header {name}", value)
        if never_stored(name) or name == "content-length":
            raise ConfigurationError(f"--header {name}: this header is never stored")
        if name in _REPLAY_HEADERS or name == replay_header:
            raise ConfigurationError(
                f"--header {name}: this header is never stored: it is a replay header, which "
                "the app adds to every replay (--replay-header-name names the app's own)"
            )
        headers.append((name, value))
    if args.body_file is not None:
        body = _read_body(args.body_file)
    else:
        body = (args.body or "").encode("utf-8")
    if body and args.status in _NO_CONTENT_STATUSES:
        raise ConfigurationError(f"--status {args.status} is answered without a body: drop it")
    if body and not any(name == "content-type" for name, _ in headers):
        headers.append(("content-type", _check_field_value("--content-type", args.content_type)))
    if args.status not in _NO_LENGTH_STATUSES:
        headers.append(("content-length", str(len(body))))
    content_type = next((value for name, value in headers if name == "content-type"), None)
    return StoredResponse(args.status, tuple(headers), body, content_type)


def _check_field_value(option: str, value: str) -> str:
    """``value``, for the header ``option`` gives, unless HTTP servers would not send it."""
    if not _FIELD_VALUE.fullmatch(value):
        raise ConfigurationError(
            f"{option}: the value must be Latin-1 text without control characters "
            "(percent-encode anything else)"
        )
    return value


def _read_body(path: Path) -> bytes:
    """``--body-file``'s bytes (``-``: standard input's), refused when it cannot be read."""
    if str(path) == "-":
        return sys.stdin.buffer.read()
    try:
        return path.read_bytes()
    except OSError as exc:  # missing, a directory, not readable by this user
        raise ConfigurationError(
            f"--body-file {path}: {exc.strerror or exc}: pass a file this user can read, or - "
            "to read the body from standard input"
        ) from exc


def _done(action: str, key: str, status: RecordStatus, *, as_json: bool) -> str:
    if as_json:
        return orjson.dumps({action: True, **_parts(key), "status": status.value}).decode()
    return f"{action}: {key} ({status.value})"


def _list_output(held: list[HeldRecord], *, stuck: bool, as_json: bool) -> str:
    rows = [
        {
            **_parts(entry.key),
            "status": entry.record.status.value,
            "createdAt": _iso(entry.record.created_at),
            "leaseUntil": _iso(entry.record.locked_until),
            "leaseExpired": entry.lease_expired,
            "recoveryPoints": [point.name for point in entry.record.checkpoints],
        }
        for entry in held
    ]
    if as_json:
        return orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode()
    lines = []
    for row, entry in zip(rows, held, strict=True):
        if entry.lease_expired:
            state = f"held for recovery since {row['leaseUntil']}"
        elif entry.record.locked_until is not None:
            state = f"running, lease until {row['leaseUntil']}"
        else:
            state = "running"
        points = ", ".join(point.name for point in entry.record.checkpoints)
        where = (
            f"{row['method']} {row['route']}  key {row['key']}  scope {row['scope'] or '-'}"
            if row["route"] is not None
            else entry.key
        )
        lines.append(
            f"{where}  created {row['createdAt']}  {state}  ({points or 'no recovery points'})"
        )
    what = "held for recovery" if stuck else "in progress"
    lines.append(f"{len(held)} record(s) {what}")
    return "\n".join(lines)
