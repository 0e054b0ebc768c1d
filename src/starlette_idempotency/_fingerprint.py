"""Request fingerprints and storage keys.

The fingerprint is SHA-256 over a canonical form of the request: method, actual path, query
parameters and the chosen headers (each stably sorted by name, so a repeated one keeps the
order of its values), and the body, whose form is named by its kind:

``json``
    A JSON body (``application/json``, ``application/*+json``), parsed by orjson and written
    back with sorted keys and no whitespace, so two encodings of one value are one request.
    Excluded fields are dropped at every depth, their names matched case-insensitively.
    So is a body labelled a form on a route that reads its key from a JSON field of it
    (``KeySource.json_field``): the app reads it as JSON too.
``json-exact``
    JSON that orjson cannot carry exactly: integers outside 64 bits (orjson reads them as
    floats), ``NaN``, ``Infinity``, ``1e400``, lone surrogates, a byte order mark, UTF-16.
    Parsed by the standard library, as Starlette and FastAPI parse it, and written back by it.
    A UTF-8 body whose excluded members alone held such values takes the ``json`` form.
``form``
    ``application/x-www-form-urlencoded``: fields stably sorted by name, so fields sent in
    another order are the same request while repeated fields keep their order; excluded
    fields dropped by name as Starlette decodes it, case-insensitively. Escapes are
    normalised only where every decoder agrees (``+`` is ``%20``, ``%41`` is ``A``): raw
    non-ASCII bytes and escaped ones stay apart, as Starlette decodes them apart, and so do
    ``%FF`` and ``%FE``, which it decodes alike. Names that some decoder may read alike
    (``%FF`` and ``%FE`` again) keep their relative order too.
``multipart``
    ``multipart/form-data``: the parts in order, each as its headers (names lower-cased,
    values as sent: its name, filename and content type) and the SHA-256 of its content, and
    the SHA-256 of a preamble and an epilogue when there is one (clients send neither); the
    boundary, which every client draws anew for each request, is left out. Excluded fields are
    dropped by name. The boundary, the charset and the field names are read from their
    parameters as Starlette reads them, by python-multipart; without it installed, a
    parameter sent twice or holding a quote or a backslash is not read. A body that is not
    well-formed multipart takes the ``bytes`` form.
``bytes;<media type>``
    Everything else, byte for byte, with its media type (parameters dropped). Also JSON
    nested deeper than 254 levels (as deep as orjson writes) and bodies that are not the JSON
    they claim to be, such as one sent with a ``Content-Encoding``: encoded bodies are never
    decoded here, so a retry must send the same encoded bytes.

Of the content type's parameters, one takes part: a ``charset`` other than UTF-8 (the default
every reader here assumes) follows the kind of a ``form``, ``multipart`` or ``bytes`` body, as
in ``multipart;charset=iso8859-1``: the app reads the same bytes as other text under it. JSON
is read from its bytes whatever the charset says; a multipart ``boundary`` only says where the
parts lie, which their form already holds; nothing else changes what the app reads.

The rule: two bodies that Python's ``json`` reads as different values (``1`` and ``1.0``,
``2**64`` and ``2**64 + 1``, ``NaN`` and ``null``) never share a fingerprint. Two it reads as
equal share one when both take the same path; one value sent once as ``json`` and once as
``json-exact`` (with and without a byte order mark, say) is two requests: a 422, never a
wrong replay.

Why one module: each canonical form is held to that one rule and read against the others (a
body that fails one form falls to the next, and its kind names the form that made it).
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import operator
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qsl, unquote

import orjson

from starlette_idempotency._types import Body

FINGERPRINT_PREFIX = "sha256:"
FINGERPRINT_SCHEME = "4"
MAX_JSON_DEPTH = 254  # orjson.dumps' limit, applied to the standard library's path as well
_SORT_KEYS = orjson.OPT_SORT_KEYS
_FORM_MEDIA_TYPE = "application/x-www-form-urlencoded"
_MULTIPART_MEDIA_TYPE = "multipart/form-data"
# Sorts (name, value) pairs by name alone (see request_fingerprint).
_BY_NAME = operator.itemgetter(0)


# A content type as its media type (parameters dropped), whether FastAPI reads it as JSON, and
# its charset as the body's kind names it (see _charset); requests send few distinct ones, so
# each is worked out once.
_MEDIA_TYPES: dict[str, tuple[str, bool, str]] = {}
_MAX_MEDIA_TYPES = 256
_CHARSET = re.compile(r';\s*charset\s*=\s*(?:"([^"]*)"|([^;\s]*))', re.IGNORECASE)


def _options_reader() -> Callable[[str], tuple[bytes, dict[bytes, bytes]]] | None:
    """python-multipart's reader of header parameters, which Starlette's multipart parser
    uses, if it is installed."""
    try:
        from python_multipart.multipart import parse_options_header
    except ImportError:  # pragma: no cover - the tests have it; they replace it to go without
        return None
    return parse_options_header


_read_options = _options_reader()


def _charset(content_type: str, media_type: str) -> str:
    """``;charset=<codec>`` for a ``charset`` parameter other than UTF-8, ``""`` without one.

    It changes how the app reads a text or form body (Starlette's multipart parser decodes
    field names, values and filenames with it), so the same bytes under another charset are
    another request. UTF-8 is the default every reader here assumes (Starlette, RFC 7578 for
    multipart, the WHATWG rules for urlencoded forms), so ``charset=utf-8`` adds nothing, and
    fingerprints stay those of the requests without it. Aliases of one codec (``latin-1``,
    ``ISO-8859-1``) are one charset. A multipart body's charset is the one Starlette's parser
    reads; any other body's is every ``charset`` in sight, as there is no telling which one
    its reader takes.
    """
    if media_type == _MULTIPART_MEDIA_TYPE and _read_options is not None:
        charset = _read_options(content_type)[1].get(b"charset")
        sent = [] if charset is None else [charset.decode("latin-1")]
    else:
        sent = [quoted or token for quoted, token in _CHARSET.findall(content_type)]
    names = []
    for value in sent:
        name = value.strip().lower()
        # An unknown one stays as sent: a reader may refuse it or fall back to another.
        with contextlib.suppress(LookupError):
            name = codecs.lookup(name).name
        names.append(name)
    if not names or names == ["utf-8"]:
        return ""
    return ";charset=" + ",".join(names)


def _media_type(content_type: str) -> tuple[str, bool, str]:
    """``content_type``'s media type, whether it is JSON, and its charset (see
    :data:`_MEDIA_TYPES`)."""
    media_type = content_type.partition(";")[0].strip().lower()
    main, _, sub = media_type.partition("/")
    is_json = main == "application" and "/" not in sub and (sub == "json" or sub.endswith("+json"))
    if len(_MEDIA_TYPES) >= _MAX_MEDIA_TYPES:
        _MEDIA_TYPES.clear()
    _MEDIA_TYPES[content_type] = known = (media_type, is_json, _charset(content_type, media_type))
    return known


def is_json_content_type(content_type: str) -> bool:
    """True for ``application/json`` and ``application/*+json`` (parameters ignored): the
    media types FastAPI reads as JSON, by the same rule."""
    return (_MEDIA_TYPES.get(content_type) or _media_type(content_type))[1]


def drop_fields(value: Any, excluded: frozenset[str]) -> bool:
    """Delete the members whose lower-cased names are in ``excluded`` from a freshly parsed
    JSON ``value``, in place and at every depth; ``False`` when ``value`` is nested deeper
    than :data:`MAX_JSON_DEPTH` (then it may be left half done).

    The walk is iterative, one level at a time, so no depth reaches the recursion limit.
    """
    level: list[Any] = [value] if type(value) is dict or type(value) is list else []
    known: set[str] = set()
    matching: set[str] = set()
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return False
        below: list[Any] = []
        push = below.append
        for node in level:
            if type(node) is dict:
                if excluded:
                    if not known.issuperset(node):
                        for name in node.keys() - known:
                            known.add(name)
                            if name.lower() in excluded:
                                matching.add(name)
                    for name in matching:
                        node.pop(name, None)
                node = node.values()
            for item in node:
                kind = type(item)
                if kind is dict or kind is list:
                    push(item)
        level = below
    return True


def json_depth_within_limit(value: Any) -> bool:
    """Whether a parsed JSON value is nested no deeper than :data:`MAX_JSON_DEPTH`."""
    return drop_fields(value, frozenset())


# Values in orjson's compact output, where a value is followed by a comma or a bracket only,
# so no quantifier here ever needs to give anything back.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_SCALAR = rb"(?>" + _STRING + rb"|-?[0-9][0-9.eE+-]*+|true|false|null)"


def _value_pattern(depth: int) -> bytes:
    """A value nested at most ``depth`` deep. Brackets go unpaired and commas optional, so
    the pattern grows linearly with ``depth``; on valid JSON it still matches exactly one
    value, as nothing but a comma or the closing bracket can follow a member."""
    value = _SCALAR
    for _ in range(depth):
        members = rb"(?:,?(?:" + _STRING + rb":)?" + value + rb")*+"
        value = rb"(?>" + _SCALAR + rb"|[\[{]" + members + rb"[\]}])"
    return value


_VALUE = _value_pattern(8)
_KELVIN_SIGN = "\u212a".encode()


@lru_cache(maxsize=64)
def _member_patterns(spelling: bytes) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """A member after another one (``,"name":1``) and the first of its object (``{"name":1,``)."""
    name = re.escape(spelling)
    return (
        re.compile(rb',"' + name + rb'":' + _VALUE + rb"(?=[,}])"),
        re.compile(rb'\{"' + name + rb'":' + _VALUE + rb"(?:,|(?=\}))"),
    )


def _cut_members(canonical: bytes, excluded: frozenset[str]) -> bytes | None:
    """``canonical`` (orjson's sorted, compact output) without the excluded members, or
    ``None`` unless every one of them can be cut out of the bytes exactly.

    Walking a parsed megabyte costs as much as parsing it; cutting members out of the output
    costs a few C-speed passes. It is exact because of the shape of that output: a quote in a
    string is always escaped, so ``,"`` and ``{"`` only begin members; ASCII letters in keys
    are written as themselves; and ``bytes.lower()`` lowers every key that ``str.lower()``
    maps onto an ASCII name, the Kelvin sign alone aside. Every case-insensitive occurrence
    of ``"name":`` is counted first; unless each one is cut (a value nested deeper than the
    pattern reaches, several spellings of the name, a key ending in an escaped quote and the
    name), the caller walks the parsed value instead.
    """
    lowered = canonical.lower()
    cuts: list[tuple[bytes, int, int]] = []
    for name in excluded:
        if not (name.isascii() and name.isprintable()) or '"' in name or "\\" in name:
            return None  # orjson escapes these, or bytes.lower() would not lower them
        if "k" in name and _KELVIN_SIGN in canonical:
            return None
        needle = b'"' + name.encode() + b'":'
        total = lowered.count(needle)
        if total:
            at = lowered.find(needle)
            leading = lowered.count(b"{" + needle)
            cuts.append((canonical[at + 1 : at + len(needle) - 2], total, leading))
    for spelling, total, leading in cuts:
        following, first = _member_patterns(spelling)
        cut = 0
        if total > leading:
            canonical, cut = following.subn(b"", canonical)
        if leading:
            canonical, cut_first = first.subn(b"{", canonical)
            cut += cut_first
        if cut != total:
            return None
    return canonical


def _exact_json(body: Body, excluded: frozenset[str]) -> tuple[str, bytes] | None:
    """The standard library's canonical form, exact for every value it parses; or the
    ``json`` form when all that orjson could not hold lay in excluded members."""
    try:
        value = json.loads(body)
        if not drop_fields(value, excluded):
            return None
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    except (ValueError, RecursionError):
        return None
    # Only UTF-8 without a byte order mark, which orjson reads too: with another encoding, the
    # body takes this form whatever is excluded, as it always has.
    if excluded and json.detect_encoding(body) == "utf-8":
        # What remains is read again by orjson, which refuses what it cannot hold (NaN, lone
        # surrogates) and turns integers past 64 bits into floats, which the "e+" test finds.
        with contextlib.suppress(orjson.JSONDecodeError):
            canonical = orjson.dumps(orjson.loads(text), option=_SORT_KEYS)
            if b"e+" not in canonical:
                return "json", canonical
    return "json-exact", text.encode("ascii")


@dataclass(frozen=True, slots=True)
class ParsedJson:
    """A JSON body parsed once: for a key read from one of its fields, then for the
    fingerprint, which takes ``value`` as its own parse when orjson made it."""

    value: Any
    by_orjson: bool


def parse_json(body: Body) -> ParsedJson | None:
    """``body`` parsed by orjson or, for what only it reads (see ``json-exact``), by the
    standard library as Starlette parses it; ``None`` when it is not JSON."""
    try:
        return ParsedJson(orjson.loads(body), by_orjson=True)
    except orjson.JSONDecodeError:
        pass
    try:
        return ParsedJson(json.loads(body), by_orjson=False)
    except (ValueError, RecursionError):
        return None


def canonical_json(
    body: Body, excluded: frozenset[str] = frozenset(), parsed: ParsedJson | None = None
) -> tuple[str, bytes] | None:
    """The canonical form of a JSON body as ``(kind, bytes)``, or ``None`` when it is not
    JSON or cannot be written exactly (nested too deep).

    ``excluded`` holds lower-cased field names to drop at every depth. ``parsed`` is the body
    already parsed, which this may change.
    """
    if parsed is not None and parsed.by_orjson:
        value = parsed.value
    else:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            return _exact_json(body, excluded)
    try:
        canonical = orjson.dumps(value, option=_SORT_KEYS)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes
        return None
    if excluded:
        dropped = _cut_members(canonical, excluded)
        if dropped is None:
            drop_fields(value, excluded)
            dropped = orjson.dumps(value, option=_SORT_KEYS)
        canonical = dropped
    # orjson reads an integer outside 64 bits as a float, and writes any float that large
    # with an exponent: "+" is rare in JSON, so the first test is one memchr.
    if b"+" in canonical and b"e+" in canonical:
        return _exact_json(body, excluded)
    return "json", canonical


def _normal_escapes() -> dict[bytes, bytes]:
    """What the two hex digits after a ``%`` become: the ASCII byte they stand for, except
    for the bytes that mean something to a form parser; anything else stays escaped."""
    escapes = {}
    digits = "0123456789abcdefABCDEF"
    for high in digits:
        for low in digits:
            byte = int(high + low, 16)
            kept = byte >= 0x80 or byte in b"&+;=%"
            escapes[f"{high}{low}".encode()] = f"%{byte:02X}".encode() if kept else bytes((byte,))
    return escapes


_NORMAL_ESCAPES = _normal_escapes()
_KEPT_ASCII_ESCAPES = [(b"%%%02X" % byte, bytes((byte,))) for byte in b"&+;=%"]
_NON_ASCII_RUN = re.compile(rb"(?:[\x80-\xff]|%[89A-F][0-9A-F])+")


def _normalised(body: bytes) -> bytes:
    """``+`` as a space, escapes as ``_normal_escapes`` says, a ``%`` that escapes nothing
    escaped itself; every other byte as it came."""
    first, *rest = body.replace(b"+", b" ").split(b"%")
    parts = [first]
    for part in rest:
        escape = _NORMAL_ESCAPES.get(part[:2])
        parts.append(b"%25" + part if escape is None else escape + part[2:])
    return b"".join(parts)


def _field_name(field: bytes) -> bytes:
    return field.partition(b"=")[0]


def _field_order(field: bytes) -> bytes:
    """The sort key of a normalised field: its name with every escape decoded and each run
    of non-ASCII bytes, raw or escaped, as one ``0x80``. Decoders differ only in what they
    make of such runs, so two names any of them reads alike have one key, and fields of
    names the app may confuse never change order."""
    name = _field_name(field)
    if name.isascii() and b"%" not in name:
        return name
    name = _NON_ASCII_RUN.sub(b"\x80", name)
    # The escapes left are those _normal_escapes keeps; "%25" goes last, or "%2526" would
    # be decoded twice.
    for escape, byte in _KEPT_ASCII_ESCAPES:
        name = name.replace(escape, byte)
    return name


def canonical_form(body: Body, excluded: frozenset[str] = frozenset()) -> bytes:
    """The canonical form of an ``application/x-www-form-urlencoded`` body.

    Each field is kept whole, its escapes normalised (see the module docstring), and the
    fields are stably sorted by name (see ``_field_order``). ``excluded`` holds lower-cased
    field names to drop, matched against the name as Starlette decodes it.
    """
    fields = [field for field in _normalised(bytes(body)).split(b"&") if field]
    if excluded:
        # Normalised names hold no "+", so unquote() decodes them as Starlette's
        # unquote_plus() decodes the original.
        fields = [
            field
            for field in fields
            if unquote(_field_name(field).decode("latin-1")).lower() not in excluded
        ]
    fields.sort(key=_field_order)
    return b"&".join(fields)


# How the two parameters read here are found without python-multipart.
_PARAMETERS = {
    "boundary": re.compile(r';\s*boundary\s*=\s*(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE),
    "name": re.compile(r';\s*name\s*=\s*(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE),
}


def _parameter(header: str, name: str) -> str | None:
    """The parameter ``name`` ("boundary" or "name") of a multipart ``Content-Type`` or a
    part's ``Content-Disposition``, as Starlette reads it: by python-multipart, which takes
    the last of a repeated parameter, unescapes a quoted one and skips a ``;`` in quotes.

    Without python-multipart the app parses multipart its own way, and parsers differ on a
    parameter sent twice, or holding quotes or backslashes: such a one is not read (``None``),
    which sends the body to the ``bytes`` form or keeps the part.
    """
    if _read_options is not None:
        read = _read_options(header)[1].get(name.encode())
        return None if read is None else read.decode("latin-1")
    found = _PARAMETERS[name].findall(header)
    if len(found) != 1:
        return None
    quoted, token = found[0]
    value: str = quoted or token
    return None if '"' in value or "\\" in value else value


def canonical_multipart(
    body: Body, content_type: str, excluded: frozenset[str] = frozenset()
) -> bytes | None:
    """The canonical form of a ``multipart/form-data`` body (see the module docstring), or
    ``None`` when it is not well-formed multipart (RFC 2046, as Starlette's parser reads it).

    Each part's content is hashed where it lies (a ``memoryview``), so no part is copied.
    """
    boundary = _parameter(content_type, "boundary")
    if not boundary:
        return None
    boundary_line = b"--" + boundary.encode("latin-1")
    delimiter = b"\r\n" + boundary_line
    # The first delimiter may open the body, without the line break before it.
    if body.startswith(boundary_line):
        preamble_end = 0
        at = len(boundary_line)
    else:
        preamble_end = body.find(delimiter)
        if preamble_end < 0:
            return None
        at = preamble_end + len(delimiter)
    view = memoryview(body)
    parts: list[tuple[list[tuple[str, str]], str]] = []
    while not body.startswith(b"--", at):  # "--" after a delimiter closes the body
        line_end = body.find(b"\r\n", at)
        if line_end < 0 or body[at:line_end].strip(b" \t"):
            return None
        start = line_end + 2
        end = body.find(delimiter, start)
        if end < 0:
            return None
        head: Body
        if body.startswith(b"\r\n", start):  # a part with no headers
            head, content = b"", start + 2
        else:
            head_end = body.find(b"\r\n\r\n", start, end)
            if head_end < 0:
                return None
            head, content = body[start:head_end], head_end + 4
        headers = []
        for line in head.split(b"\r\n") if head else ():
            name, colon, value = line.partition(b":")
            if not colon or not name or name[:1] in b" \t":  # folded or malformed
                return None
            headers.append((name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")))
        if not (excluded and _part_name(headers) in excluded):
            parts.append((headers, hashlib.sha256(view[content:end]).hexdigest()))
        at = end + len(delimiter)
    # Parsers skip them, but one that finds other delimiters than these finds its parts
    # there. The line break after the closing delimiter is the closing delimiter's.
    epilogue_start = at + 2 + (2 if body.startswith(b"\r\n", at + 2) else 0)
    if not preamble_end and epilogue_start >= len(body):
        return orjson.dumps(parts)  # the form every body had before they counted
    return orjson.dumps(
        {
            "preamble": hashlib.sha256(view[:preamble_end]).hexdigest(),
            "parts": parts,
            "epilogue": hashlib.sha256(view[epilogue_start:]).hexdigest(),
        }
    )


def _part_name(headers: list[tuple[str, str]]) -> str | None:
    """The lower-cased field name in a part's ``Content-Disposition`` (the last one, as
    Starlette reads it), if it has one."""
    dispositions = [value for name, value in headers if name == "content-disposition"]
    if not dispositions:
        return None
    name = _parameter(dispositions[-1], "name")
    return None if name is None else name.lower()


def raw_body_form(
    body: Body, *, content_type: str, excluded: frozenset[str], parsed: ParsedJson | None = None
) -> tuple[str, Body]:
    """The body as the ``raw`` fingerprint sees it, as ``(kind, canonical bytes)``: JSON,
    urlencoded and multipart forms canonicalised, anything else as its bytes (see the module
    docstring). ``parsed`` is a JSON body already parsed (see :class:`ParsedJson`)."""
    media_type, is_json, charset = _MEDIA_TYPES.get(content_type) or _media_type(content_type)
    # A body the route read as JSON (its key is a field of it) is JSON to the app, whatever its
    # label: as a form, two JSON values would be one ("+" and " ", "%41" and "A"). Under any
    # other label it keeps its exact bytes, which never make two values one.
    if is_json or (parsed is not None and media_type == _FORM_MEDIA_TYPE):
        # read from its bytes (UTF-8, -16 or -32, as json.loads tells), whatever charset
        canonical = canonical_json(body, excluded, parsed)
        if canonical is not None:
            return canonical
    elif media_type == _FORM_MEDIA_TYPE:
        return "form" + charset, canonical_form(body, excluded)
    elif media_type == _MULTIPART_MEDIA_TYPE:
        multipart = canonical_multipart(body, content_type, excluded)
        if multipart is not None:
            return "multipart" + charset, multipart
    # The media type goes with the bytes: one body under two content types may be two requests
    # to the app (JSON for one, a form or plain text for the other).
    return f"bytes;{media_type}{charset}", body


def request_fingerprint(
    *,
    operation: str,
    method: str,
    path: str,
    query_string: bytes,
    headers: Iterable[tuple[str, str]],
    body_kind: str,
    body: Body,
) -> str:
    """``sha256:<hex>`` of the canonical request.

    ``operation`` is the route's ``operation=`` (``""`` without one): never the handler's
    name, so that a retry across a renamed or moved handler is the same request. ``headers``
    are the (lower-cased name, value) pairs chosen to take part; ``body`` is already
    in canonical form, and ``body_kind`` names that form ("json", "json-exact", "form",
    "multipart", "bytes;<media type>" or "command").
    """
    # Sorted by name only: a repeated parameter or header keeps the order of its values, which
    # the app sees (Starlette's ``get`` takes the last query value and the first header value).
    query = (
        sorted(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True), key=_BY_NAME)
        if query_string
        else []
    )
    # The head is one JSON array, so it ends unambiguously before the body bytes begin.
    head = orjson.dumps([operation, method, path, query, sorted(headers, key=_BY_NAME), body_kind])
    digest = hashlib.sha256(head)
    digest.update(body)
    return FINGERPRINT_PREFIX + digest.hexdigest()


def fingerprint_version(mode: str, route_version: str) -> str:
    """What a stored fingerprint means: this library's scheme, the mode, the route's version.

    A record of another version was fingerprinted differently, so comparing it would be
    meaningless; ``on_fingerprint_change`` decides instead.
    """
    return f"{FINGERPRINT_SCHEME}.{mode}.{route_version}"
