"""exclude_fields on JSON: the fast cut out of orjson's output agrees with walking the value."""

from __future__ import annotations

import json
import sys
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from starlette_idempotency._fingerprint import canonical_json, drop_fields
from tests.support.json_values import json_values, same


def without(value: Any, excluded: frozenset[str]) -> Any:
    """The reference: a recursive copy without the excluded members."""
    if isinstance(value, dict):
        return {
            name: without(item, excluded)
            for name, item in value.items()
            if name.lower() not in excluded
        }
    if isinstance(value, list):
        return [without(item, excluded) for item in value]
    return value


# Names that stress the byte-level cut: case variants, the Kelvin sign (lower-cased to "k"),
# an escaped quote before the name, a name inside a longer one, non-ASCII.
NAMES = ["a", "A", "ka", "KA", "\u212aa", 'x"a', "xa", "ab", "\u00e9", "\u00c9", "", " a"]
EXCLUDED = [{"a"}, {"ka"}, {"a", "ka"}, {"\u00e9"}, {'x"a'}, {""}, {" a", "ab"}, {"a\\"}]
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(['"a":', ',"a":1', '{"a":1}', "\\", 'x\\"a'])
    | st.text(max_size=4)
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=3), children, max_size=4)
    ),
    max_leaves=16,
)


@given(values, st.sampled_from(EXCLUDED), st.booleans())
@example({"a": 1, "b": {"A": [1, {"a": "x"}]}}, {"a"}, False)
@example({"\u212aa": 1, "ka": 2, "b": 3}, {"ka"}, False)
@example({'x"a': 1, "a": 2}, {"a"}, False)
@example({"a": {"a": 1}, "b": [{"a": [1]}]}, {"a"}, True)
@example({"a": 1, "A": 2}, {"a"}, False)
def test_excluded_members_are_dropped_exactly(value: Any, excluded: set[str], spaced: bool) -> None:
    body = json.dumps(value, indent=2 if spaced else None).encode()
    kept = without(value, frozenset(excluded))
    result = canonical_json(body, frozenset(excluded))
    assert result is not None
    if result[0] == "json":
        assert result[1] == orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    else:  # a float past 1e16 or an "e+" in a string: the exact path
        assert result[0] == "json-exact"
        assert same(json.loads(result[1]), kept)


def test_the_kelvin_sign_is_the_only_non_ascii_letter_lowered_to_ascii() -> None:
    """The byte-level cut relies on it (and the Kelvin sign sends the body to the walk);
    U+0130 lowers to "i" plus a combining dot, never to an ASCII name."""
    lowered_to_ascii = [
        chr(code)
        for code in range(0x80, sys.maxunicode + 1)
        if chr(code).lower().isascii() and chr(code).lower()
    ]
    assert lowered_to_ascii == ["\u212a"]


def test_drop_fields_walks_deep_values_without_recursion() -> None:
    value: Any = {"keep": 1, "Nonce": 2}
    for _ in range(120):  # 241 levels
        value = [{"nonce": 3, "inner": value}]
    assert drop_fields(value, frozenset({"nonce"}))
    assert b"nonce" not in orjson.dumps(value).lower()
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    assert not drop_fields(deep, frozenset({"nonce"}))


@pytest.mark.parametrize(
    "body",
    [
        b'{"Nonce": 1, "a": {"NONCE": {"x": 1}}, "b": [{"nOnCe": [2]}]}',
        b'{"nonce": 1, "a": "\\"nonce\\": 2", "b": {"nonce": null}}',
    ],
)
def test_excluded_members_holding_objects_or_arrays(body: bytes) -> None:
    result = canonical_json(body, frozenset({"nonce"}))
    assert result is not None
    assert b"nonce" not in result[1].replace(b'\\"nonce\\"', b"").lower()


def encode(value: Any, style: int) -> bytes:
    """Compact, spaced, with non-ASCII escaped, or behind a byte order mark."""
    text = json.dumps(value, indent=2 if style == 1 else None, ensure_ascii=style == 2)
    return (b"\xef\xbb\xbf" if style == 3 else b"") + text.encode("utf-8", "surrogatepass")


@given(
    st.dictionaries(st.text(max_size=3), json_values, max_size=3),
    json_values,
    json_values,
    st.sampled_from([0, 1, 2, 3]),
)
@example({"items": [1]}, float("nan"), 812.5, 0)
@example({"items": [1]}, "\ud800", "x", 2)
@example({"items": [1]}, 2**64, 1, 0)
@example({"items": [float("nan")]}, float("nan"), 1, 0)
@example({"items": [1]}, float("inf"), 1, 3)
def test_what_an_excluded_field_holds_never_changes_the_form(
    kept: dict[str, Any], first: Any, second: Any, style: int
) -> None:
    """NaN, a lone surrogate or an integer orjson cannot hold in an excluded field is no
    reason to take another form than the same body with a finite number there."""
    excluded = frozenset({"clientlatencyms"})
    forms = [
        canonical_json(encode({**kept, "clientLatencyMs": value}, style), excluded)
        for value in (first, second)
    ]
    assert forms[0] is not None
    assert forms[0] == forms[1]


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b'{"items": [NaN], "nonce": 1}', "json-exact"),
        (b'{"items": ["\\ud800"], "nonce": 1}', "json-exact"),
        (b'{"items": [18446744073709551616], "nonce": 1}', "json-exact"),
        (b'\xef\xbb\xbf{"items": [1], "nonce": NaN}', "json-exact"),
        ('{"items": [1], "nonce": NaN}'.encode("utf-16"), "json-exact"),
        (b'{"items": [1], "nonce": NaN}', "json"),
    ],
)
def test_what_orjson_cannot_hold_outside_excluded_fields_keeps_the_exact_form(
    body: bytes, kind: str
) -> None:
    """Values orjson cannot hold that are kept, and encodings it cannot read, take the exact
    form as they always have (a stored fingerprint still matches)."""
    result = canonical_json(body, frozenset({"nonce"}))
    assert result is not None
    assert result[0] == kind
