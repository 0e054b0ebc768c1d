"""Request fingerprints and storage keys.

The fingerprint is SHA-256 over a canonical form of the request: method, actual path, sorted
query parameters, the chosen headers and the body. JSON bodies are canonicalised first (keys
sorted, whitespace dropped, excluded fields removed at every depth, matched case-insensitively),
so two encodings of one request are the same request. Anything else is hashed as bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

import orjson

FINGERPRINT_PREFIX = "sha256:"
FINGERPRINT_SCHEME = "1"
_SORT_KEYS = orjson.OPT_SORT_KEYS


def is_json_content_type(content_type: str) -> bool:
    """True for ``application/json`` and any ``*+json`` media type (parameters ignored)."""
    media_type = content_type.partition(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _without_fields(value: Any, excluded: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {
            name: _without_fields(item, excluded)
            for name, item in value.items()
            if name.lower() not in excluded
        }
    if isinstance(value, list):
        return [_without_fields(item, excluded) for item in value]
    return value


def canonical_json(body: bytes, excluded: frozenset[str] = frozenset()) -> bytes | None:
    """The canonical encoding of a JSON body, or ``None`` when it is not valid JSON.

    ``excluded`` holds lower-cased field names to drop at every depth.
    """
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if excluded:
        value = _without_fields(value, excluded)
    return orjson.dumps(value, option=_SORT_KEYS)


def raw_body_form(body: bytes, *, json_body: bool, excluded: frozenset[str]) -> tuple[str, bytes]:
    """The body as the ``raw`` fingerprint sees it: ``("json", canonical JSON)`` when it is JSON
    that parses, else ``("bytes", body)``."""
    if json_body:
        canonical = canonical_json(body, excluded)
        if canonical is not None:
            return "json", canonical
    return "bytes", body


def request_fingerprint(
    *,
    method: str,
    path: str,
    query_string: bytes,
    headers: Iterable[tuple[str, str]],
    body_kind: str,
    body: bytes,
) -> str:
    """``sha256:<hex>`` of the canonical request.

    ``headers`` are the (lower-cased name, value) pairs chosen to take part; ``body`` is already
    in canonical form, and ``body_kind`` names that form ("json", "bytes" or "command").
    """
    query = (
        sorted(parse_qsl(query_string.decode("latin-1"), keep_blank_values=True))
        if query_string
        else []
    )
    # The head is one JSON array, so it ends unambiguously before the body bytes begin.
    head = orjson.dumps([method, path, query, sorted(headers), body_kind])
    digest = hashlib.sha256(head)
    digest.update(body)
    return FINGERPRINT_PREFIX + digest.hexdigest()


def fingerprint_version(mode: str, route_version: str) -> str:
    """What a stored fingerprint means: this library's scheme, the mode, the route's version.

    A record of another version was fingerprinted differently, so comparing it would be
    meaningless; ``on_fingerprint_change`` decides instead.
    """
    return f"{FINGERPRINT_SCHEME}.{mode}.{route_version}"


_KEY_PART_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})


def storage_key(scope_id: str, method: str, route_template: str, key: str) -> str:
    """``scope:METHOD:template:key``, each part escaped so that no two tuples share a key.

    The store adds its prefix (``idempotency:`` by default). Braces are escaped too, so Redis
    Cluster never reads a route template's ``{param}`` as a hash tag.
    """
    escapes = _KEY_PART_ESCAPES
    return (
        f"{scope_id.translate(escapes)}:{method.translate(escapes)}:"
        f"{route_template.translate(escapes)}:{key.translate(escapes)}"
    )
