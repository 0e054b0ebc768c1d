"""Reference semantics the property suite judges the middleware by, written from the README
and the HTTP and Structured-Field RFCs rather than from the middleware's code.

- ``reference_key``: which ``Idempotency-Key`` field lines name a key, and which key.
- ``canonical`` and ``raw_meaning``: a value as the app sees it, as one comparable string.
  Python's ``json`` module is the parser (``Request.json()`` uses it); ``1`` and ``1.0``
  differ, ``NaN`` compares by its token, and the walk is iterative, so a 1000-deep value
  costs no recursion.
"""

from __future__ import annotations

import decimal
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

MAX_KEY_LENGTH = 255
# Headers a replay may differ in (README, "Replays"), plus the replay markers themselves.
UNCOMPARED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "date",
        "server",
        "set-cookie",
        "x-idempotent-replay",
        "x-idempotent-body-omitted",
    }
)

# Headers that describe a body, which a replay without the body (README, "Full response or
# reference") leaves out.
BODY_HEADERS = frozenset({"content-length", "content-type", "content-encoding"})


@dataclass(frozen=True, slots=True)
class KeyVerdict:
    """The key the field lines carry (``key``), or why they carry none (``problem``)."""

    key: str | None
    problem: str | None = None


def _unquote(text: str) -> str | None:
    """An RFC 8941 sf-string's content, or ``None`` when ``text`` is not exactly one."""
    if len(text) < 2 or not (text.startswith('"') and text.endswith('"')):
        return None
    out: list[str] = []
    inner = text[1:-1]
    index = 0
    while index < len(inner):
        char = inner[index]
        if char == "\\":
            if index + 1 >= len(inner) or inner[index + 1] not in '"\\':
                return None
            out.append(inner[index + 1])
            index += 2
            continue
        if char == '"' or not " " <= char <= "~":
            return None
        out.append(char)
        index += 1
    return "".join(out)


def reference_key(values: Sequence[bytes]) -> KeyVerdict:
    """The README's key rules, with RFC 9110 section 5.3 on top: field lines may be combined
    into one comma-separated line on the way, so an unquoted comma is a list of keys, which
    the README answers with 400 ("header sent twice")."""
    if not values:
        return KeyVerdict(None, "missing")
    if len(values) > 1:
        return KeyVerdict(None, "sent more than once")
    try:
        text = values[0].decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        return KeyVerdict(None, "not ASCII")
    if text.startswith('"'):
        key = _unquote(text)
        if key is None:
            return KeyVerdict(None, "not a valid sf-string")
    elif any(not "!" <= char <= "~" for char in text):
        return KeyVerdict(None, "not visible ASCII")
    elif "," in text:
        return KeyVerdict(None, "a comma-separated list (combined field lines)")
    else:
        key = text
    if not key:
        return KeyVerdict(None, "empty")
    if len(key) > MAX_KEY_LENGTH:
        return KeyVerdict(None, "too long")
    return KeyVerdict(key)


class _Close:
    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token


class _Key:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


_CLOSE_ARRAY = _Close("]")
_CLOSE_OBJECT = _Close("}")


def float_token(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)  # keeps -0.0 apart from 0.0


def canonical(value: Any, excluded: frozenset[str] = frozenset()) -> str:
    """A string equal for two values exactly when the app would see the same value.

    Object keys are sorted; ``excluded`` names (lower case) are dropped at every depth.
    """
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Close):
            out.append(item.token)
        elif isinstance(item, _Key):
            out.append(json.dumps(item.name) + ":")
        elif item is None:
            out.append("null,")
        elif item is True or item is False:
            out.append(f"{str(item).lower()},")
        elif isinstance(item, int):
            out.append(f"int({item}),")
        elif isinstance(item, float):
            out.append(f"float({float_token(item)}),")
        elif isinstance(item, decimal.Decimal):
            out.append(f"decimal({item.normalize()}),")
        elif isinstance(item, str):
            out.append(json.dumps(item) + ",")  # escapes lone surrogates, so never fails
        elif isinstance(item, list | tuple):
            out.append("[")
            stack.append(_CLOSE_ARRAY)
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            out.append("{")
            stack.append(_CLOSE_OBJECT)
            entries = sorted((str(k), v) for k, v in item.items() if str(k).lower() not in excluded)
            for name, child in reversed(entries):
                stack.append(child)
                stack.append(_Key(name))
        else:
            out.append(f"{type(item).__name__}({item!r}),")
    return "".join(out)


def raw_meaning(body: bytes) -> str:
    """A body as an endpoint that reads raw bytes may understand it, whatever its Content-Type:
    the JSON value when Python's json module reads one, else its urlencoded-form reading
    (every body has one; for a body that is no form it is a tolerant reading of its bytes)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return form_meaning(body)
    return "json:" + canonical(value)


def form_meaning(body: bytes) -> str:
    """An urlencoded form as an app reads it: fields decoded as Starlette decodes them
    (latin-1, then ``unquote_plus``), in a stable order by name, so that fields sent in another
    order are one form and repeated fields keep theirs (as JSON objects ignore key order)."""
    fields = []
    for piece in re.split(rb"[&;]", body):
        if piece:
            name, _, value = piece.partition(b"=")
            fields.append(
                (unquote_plus(name.decode("latin-1")), unquote_plus(value.decode("latin-1")))
            )
    fields.sort(key=lambda field: field[0])
    return "form:" + json.dumps(fields)


def comparable_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """Response headers as a replay must repeat them: lower-cased, in order, minus the ones the
    README lets a replay drop."""
    headers = []
    for name, value in raw:
        lowered = name.decode("latin-1").lower()
        if lowered not in UNCOMPARED_HEADERS:
            headers.append((lowered, value.decode("latin-1")))
    return headers
