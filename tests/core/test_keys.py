from __future__ import annotations

import pytest

from starlette_idempotency._keys import InvalidKey, parse_key


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
