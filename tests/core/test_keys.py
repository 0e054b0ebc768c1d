from __future__ import annotations

import jsonschema_rs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from starlette_idempotency._keys import InvalidKey, key_pattern, parse_key
from starlette_idempotency._openapi.fragments import key_schema


def parse(raw: bytes, max_length: int = 255) -> str | InvalidKey:
    return parse_key(raw, header_name="Idempotency-Key", max_length=max_length)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (b"a:b{c}%d", "a:b{c}%d"),
        (b'"abc"', "abc"),
        (b'"with space"', "with space"),
        (b'"esc\\"aped\\\\"', 'esc"aped\\'),
        (b'ab"c', 'ab"c'),
        (b"!~", "!~"),
        (b'"a,b"', "a,b"),
    ],
)
def test_valid_keys(raw: bytes, key: str) -> None:
    assert parse(raw) == key


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"", "must not be empty"),
        (b'""', "must not be empty"),
        (b"has space", "visible ASCII"),
        (b"tab\tin", "visible ASCII"),
        (b"ctl\x01", "visible ASCII"),
        (b"\xc3\xa9t\xc3\xa9", "visible ASCII"),
        (b'"unterminated', "quoted string"),
        (b'"bad\\escape"', "quoted string"),
        (b'"inner"quote"', "quoted string"),
        (b'"ctl\x01"', "quoted string"),
        (b"key-a,key-b", "sent only once"),
        (b"key-a,", "sent only once"),
        (b'"key-a","key-b"', "quoted string"),
    ],
)
def test_invalid_keys(raw: bytes, fragment: str) -> None:
    result = parse(raw)
    assert isinstance(result, InvalidKey)
    assert fragment in result.message
    assert result.message.startswith("Idempotency-Key")


def test_length_limit_applies_after_unquoting() -> None:
    assert parse(b"k" * 255) == "k" * 255
    assert parse(b'"' + b"k" * 255 + b'"') == "k" * 255
    too_long = parse(b"k" * 256)
    assert isinstance(too_long, InvalidKey)
    assert too_long.too_long
    assert too_long.message == "Idempotency-Key must not exceed 255 characters"


def test_messages_name_the_configured_header() -> None:
    result = parse_key(b"", header_name="X-Request-Key", max_length=10)
    assert isinstance(result, InvalidKey)
    assert result.message == "X-Request-Key must not be empty"


# What the header's OpenAPI schema accepts is what the middleware accepts. Values are HTTP
# field values: the server strips the whitespace around them before anyone sees them.
_ALPHABET = st.sampled_from([*map(chr, range(0x20, 0x7F)), "\t", "\x00", "\x7f", "é", "\n"])
_QUOTED_PARTS = st.one_of(_ALPHABET, st.sampled_from(['\\"', "\\\\", "\\", '"']))


@st.composite
def header_values(draw: st.DrawFn) -> str:
    """Tokens, quoted strings and near misses of both, around the length limit."""
    if draw(st.booleans()):
        return draw(st.text(_ALPHABET, max_size=12))
    inner = "".join(draw(st.lists(_QUOTED_PARTS, max_size=12)))
    return draw(st.sampled_from(['"', ""])) + inner + draw(st.sampled_from(['"', "", '""']))


@given(
    max_length=st.integers(min_value=1, max_value=8),
    value=st.one_of(
        header_values(), st.from_regex(key_pattern(8), fullmatch=True), st.text(max_size=20)
    ),
)
def test_the_documented_key_schema_accepts_exactly_what_parse_key_accepts(
    max_length: int, value: str
) -> None:
    value = value.strip(" \t")
    schema = jsonschema_rs.validator_for(key_schema(max_length))
    parsed = parse(value.encode("utf-8"), max_length=max_length)
    assert schema.is_valid(value) == isinstance(parsed, str), (value, parsed)


@pytest.mark.parametrize("max_length", [1, 2, 255])
def test_the_longest_keys_fit_the_documented_schema(max_length: int) -> None:
    schema = jsonschema_rs.validator_for(key_schema(max_length))
    token, quoted = "k" * max_length, '"' + '\\"' * max_length + '"'
    for value in (token, quoted):
        assert isinstance(parse(value.encode(), max_length=max_length), str)
        assert schema.is_valid(value)
        assert not schema.is_valid(value[:-1] + "k" + value[-1:])  # one character too many
