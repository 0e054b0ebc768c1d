"""JSON bodies: distinct values never share a fingerprint, whatever orjson can represent."""

from __future__ import annotations

import json
import math
import random
import sys
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from starlette_idempotency._fingerprint import (
    MAX_JSON_DEPTH,
    canonical_json,
    raw_body_form,
    request_fingerprint,
)
from starlette_idempotency._types import Body
from tests.support.json_values import json_values, same

JSON = "application/json"


def fingerprint(body: bytes, excluded: frozenset[str] = frozenset()) -> str:
    kind, canonical = raw_body_form(body, content_type=JSON, excluded=excluded)
    return request_fingerprint(
        operation="",
        method="POST",
        path="/p",
        query_string=b"",
        headers=(),
        body_kind=kind,
        body=canonical,
    )


def encode(value: Any, style: int = 0) -> bytes:
    """``value`` as a client might send it: compact, spaced, or with non-ASCII escaped."""
    text = json.dumps(
        value,
        ensure_ascii=style == 2,
        indent=2 if style == 1 else None,
        separators=(",", ":") if style == 0 else None,
    )
    return text.encode("utf-8", "surrogatepass")  # json.loads decodes bytes the same way


@given(json_values, st.sampled_from([0, 1, 2]))
@example(2**64, 0)
@example({"amount": 1180591620717411303424}, 0)
@example([float("nan"), float("inf"), -float("inf"), None], 0)
@example("\ud800", 0)
@example(-0.0, 0)
def test_the_canonical_form_holds_the_value_the_app_reads(value: Any, style: int) -> None:
    """Re-reading the canonical form gives back exactly what json.loads reads from the body:
    so two bodies the app reads differently never share a canonical form."""
    body = encode(value, style)
    result = canonical_json(body)
    assert result is not None
    kind, canonical = result
    assert kind in ("json", "json-exact")
    assert same(json.loads(canonical), json.loads(body))


def neighbours(value: Any) -> list[Any]:
    """Values close to ``value`` that the app still reads as different."""
    if type(value) is int:
        near: list[Any] = [value + 1, value - 1]
        if abs(value) < 2**1000:
            near.append(float(value))
        return near
    if type(value) is float:
        return [-value, math.nextafter(value, math.inf), None] if math.isfinite(value) else [None]
    if type(value) is str:
        return [value + "\ud800", value.upper() + "x"]
    if isinstance(value, list):
        return [[*value, None]] + [
            [*value[:i], n, *value[i + 1 :]] for i, v in enumerate(value) for n in neighbours(v)
        ]
    if isinstance(value, dict):
        return [{**value, "\ud800": 1}] + [
            {**value, k: n} for k, v in value.items() for n in neighbours(v)
        ]
    return [0, False, "null"]


@given(json_values, json_values)
@example({"amount": 2**64}, {"amount": 2**64 + 1})
@example([float("nan")], [float("inf")])
def test_different_values_never_share_a_fingerprint(value: Any, other: Any) -> None:
    for candidate in [other, *neighbours(value)]:
        if not same(candidate, value):
            assert fingerprint(encode(value)) != fingerprint(encode(candidate))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b'{"amount": 1180591620717411303424}', b'{"amount": 1180591620717411304424}'),
        (b"18446744073709551616", b"18446744073709551617"),
        (b"18446744073709551616", b"18446744073709551616.0"),
        (b"-9223372036854775809", b"-9223372036854775810"),
        (b"NaN", b"null"),
        (b"NaN", b"Infinity"),
        (b"Infinity", b"-Infinity"),
        (b"1e400", b"null"),
        (b'"\\ud800"', b'"\\ud801"'),
        (b"[1]", b"[1.0]"),
        (b"0.0", b"-0.0"),
    ],
)
def test_values_orjson_cannot_hold_stay_apart(first: bytes, second: bytes) -> None:
    assert fingerprint(first) != fingerprint(second)


def test_integers_orjson_holds_take_the_fast_path() -> None:
    assert canonical_json(b"18446744073709551615") == ("json", b"18446744073709551615")
    assert canonical_json(b"-9223372036854775808") == ("json", b"-9223372036854775808")
    assert canonical_json(b"18446744073709551616") == ("json-exact", b"18446744073709551616")


@pytest.mark.parametrize("number", [2**64, -(2**63) - 1, 2**65 + 1, 10**30, -(10**30)])
def test_orjson_writes_big_floats_with_an_exponent(number: int) -> None:
    """What the exact path's trigger relies on: an integer outside 64 bits comes back from
    orjson as a float, written with ``e+``."""
    assert b"e+" in orjson.dumps(orjson.loads(str(number)))


numbers = st.from_regex(
    r"-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE][-+]?[0-9]{1,3})?", fullmatch=True
)


@given(st.lists(numbers, min_size=1, max_size=4))
@example(["1e400", "1.0000000000000000001", "123456789012345678901234567890"])
def test_number_literals_read_as_the_app_reads_them(literals: list[str]) -> None:
    body = ("[" + ",".join(literals) + "]").encode()
    result = canonical_json(body)
    assert result is not None
    assert same(json.loads(result[1]), json.loads(body))


@given(json_values, st.randoms(use_true_random=False))
def test_key_order_and_whitespace_never_matter(value: Any, rnd: random.Random) -> None:
    def shuffled(item: Any) -> Any:
        if isinstance(item, dict):
            pairs = [(k, shuffled(v)) for k, v in item.items()]
            rnd.shuffle(pairs)
            return dict(pairs)
        if isinstance(item, list):
            return [shuffled(v) for v in item]
        return item

    assert fingerprint(encode(value)) == fingerprint(encode(shuffled(value), rnd.choice([0, 1, 2])))


def test_a_byte_order_mark_still_reads_as_json() -> None:
    assert canonical_json(b'\xef\xbb\xbf{"b": 1, "a": NaN}') == ("json-exact", b'{"a":NaN,"b":1}')


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("excluded", [frozenset(), frozenset({"a"})])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 300, 900, 1100, 100_000])
def test_deep_nesting_is_hashed_as_bytes(depth: int, excluded: frozenset[str]) -> None:
    for body in (nested(depth), b'{"a": NaN, "b": ' + nested(depth) + b"}"):
        kind = ("bytes;application/json", body)
        assert raw_body_form(body, content_type=JSON, excluded=excluded) == kind


def test_deep_nesting_does_not_depend_on_the_stack() -> None:
    """A body deep enough to hit the recursion limit in json.loads is bytes however deep the
    caller's stack is, so a retry fingerprints as its first request did."""
    body = b'{"a": NaN, "b": ' + nested(MAX_JSON_DEPTH) + b"}"

    def at_depth(frames: int) -> tuple[str, Body]:
        if frames:
            return at_depth(frames - 1)
        return raw_body_form(body, content_type=JSON, excluded=frozenset())

    limit = sys.getrecursionlimit()
    assert {at_depth(0)[0], at_depth(limit - 400)[0]} == {"bytes;application/json"}
    assert raw_body_form(nested(MAX_JSON_DEPTH), content_type=JSON, excluded=frozenset())[0] == (
        "json"
    )


@given(st.binary(max_size=64), st.sampled_from([frozenset(), frozenset({"a", "ka"})]))
@example(b"\xed\xa0\x80", frozenset())
@example(b'"\xed\xa0\x80"', frozenset())
@example(b"1" * 5000, frozenset())
def test_any_bytes_give_a_fingerprint(body: bytes, excluded: frozenset[str]) -> None:
    kind, canonical = raw_body_form(body, content_type=JSON, excluded=excluded)
    assert kind in ("json", "json-exact", "bytes;application/json")
    assert isinstance(canonical, bytes)
