"""Urlencoded forms: field order does not matter, what the app decodes differently does."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Hashable
from typing import TypeVar
from urllib.parse import unquote_plus, unquote_to_bytes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from starlette_idempotency._fingerprint import canonical_form, raw_body_form

FORM = "application/x-www-form-urlencoded"

STARLETTE_VERSION = tuple(
    int(part) for part in importlib.metadata.version("starlette").split(".")[:2]
)


def starlette_fields(body: bytes) -> list[tuple[str, str]]:
    """What Starlette's FormParser makes of a body: python-multipart's QuerystringParser
    splits on "&" and skips empty fields; each part is unquote_plus'ed from latin-1."""
    fields = []
    for piece in body.split(b"&"):
        if piece:
            name, _, value = piece.partition(b"=")
            fields.append(
                (unquote_plus(name.decode("latin-1")), unquote_plus(value.decode("latin-1")))
            )
    return fields


def byte_fields(body: bytes) -> list[tuple[bytes, bytes]]:
    """What a decoder working on bytes makes of it."""
    return [
        (unquote_to_bytes(name.replace(b"+", b" ")), unquote_to_bytes(value.replace(b"+", b" ")))
        for name, _, value in (piece.partition(b"=") for piece in body.split(b"&") if piece)
    ]


T = TypeVar("T", bound=Hashable)


def by_name(fields: list[tuple[T, T]]) -> dict[T, list[T]]:
    """The app's view up to field order: each name's values, in order (``getlist``)."""
    grouped: dict[T, list[T]] = defaultdict(list)
    for name, value in fields:
        grouped[name].append(value)
    return dict(grouped)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"b=2&a=1", b"a=1&b=2"),
        (b"a=1&b=2&a=3", b"b=2&a=1&a=3"),
        (b"a=1&&b=2&", b"a=1&b=2"),
        (b"n=x+y", b"n=x%20y"),
        (b"%61=1", b"a=1"),
        (b"n=%c3%a9", b"n=%C3%A9"),
    ],
)
def test_encodings_of_one_form_share_a_canonical_form(first: bytes, second: bytes) -> None:
    assert canonical_form(first) == canonical_form(second)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"a=1&a=2", b"a=2&a=1"),  # repeated fields keep their order
        (b"n=+", b"n=%2B"),
        (b"n=\xc3\xa9", b"n=%C3%A9"),  # Starlette: "Ã©" and "é"
        (b"n=%FF", b"n=%FE"),  # Starlette reads both as U+FFFD, bytes apart
        (b"%FF=1&%FE=2", b"%FE=2&%FF=1"),  # names Starlette confuses keep their order
        (b"\xc3=1&%C3%83=2", b"%C3%83=2&\xc3=1"),  # both "Ã" to Starlette
        (b"a", b"a="),
        (b"a=1%262", b"a=1&2"),
        (b"a%3Db=1", b"a=b=1"),
        (b"a=1;b=2", b"a=1%3Bb=2"),
    ],
)
def test_different_forms_never_share_a_canonical_form(first: bytes, second: bytes) -> None:
    assert canonical_form(first) != canonical_form(second)


def test_excluded_fields_match_the_decoded_name_case_insensitively() -> None:
    excluded = frozenset({"nonce", "sent at"})
    base = canonical_form(b"a=1", excluded)
    for body in (b"nonce=1&a=1", b"a=1&Nonce=2", b"%4Eonce=3&a=1", b"a=1&SENT+AT=4&sent%20at=5"):
        assert canonical_form(body, excluded) == base
    assert canonical_form(b"a=1&nonces=1", excluded) != base


def test_forms_take_their_own_kind() -> None:
    excluded = frozenset({"b"})
    assert raw_body_form(b"c=3&b=2&a=1", content_type=FORM, excluded=excluded) == (
        "form",
        b"a=1&c=3",
    )
    assert raw_body_form(b"{}", content_type=f"{FORM}; charset=utf-8", excluded=excluded) == (
        "form",
        b"{}",
    )


# Spellings of one unit; only the first group's spellings are alike for every decoder.
ALIKE = [[b"a", b"%61"], [b" ", b"+", b"%20"], [b"%2B", b"%2b"], [b"%C3%A9", b"%c3%A9"], [b"1"]]
TRICKY = [
    [b"\xc3\xa9", b"%C3%A9"],
    [b"\xff", b"%FF", b"%fe"],
    [b"%", b"%25"],
    [b";", b"%3B"],
    [b"=", b"%3D"],
    [b"%26"],
    [b"\xc3", b"%C3%83"],
]
GROUPS = ALIKE + TRICKY
Form = list[tuple[list[int], list[int]]]
names = st.lists(st.integers(len(ALIKE) - 1, len(GROUPS) - 1), min_size=1, max_size=2)
values = st.lists(st.integers(0, len(GROUPS) - 1), max_size=3)
forms = st.lists(st.tuples(names, values), max_size=5)


def spell(form: Form, draw: Callable[[st.SearchStrategy[bytes]], bytes]) -> list[bytes]:
    """The fields of one body for ``form``, each unit in a spelling drawn from its group."""

    def unit(index: int) -> bytes:
        return draw(st.sampled_from(GROUPS[index]))

    return [b"".join(map(unit, name)) + b"=" + b"".join(map(unit, value)) for name, value in form]


@given(forms, st.data())
def test_a_shared_canonical_form_is_one_request_to_every_decoder(
    form: Form, data: st.DataObject
) -> None:
    """The same fields in another order: when the two bodies share a canonical form,
    Starlette and a bytes decoder both read each name's values alike."""
    fields = spell(form, data.draw)
    first = b"&".join(fields)
    second = b"&".join(data.draw(st.permutations(fields)))
    if canonical_form(first) == canonical_form(second):
        assert by_name(starlette_fields(first)) == by_name(starlette_fields(second))
        assert by_name(byte_fields(first)) == by_name(byte_fields(second))


@given(
    st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 4), max_size=4))), st.randoms()
)
def test_reordered_fields_and_alike_spellings_share_a_canonical_form(
    form: list[tuple[int, list[int]]], rnd: random.Random
) -> None:
    def spelled(fields: list[tuple[int, list[int]]]) -> bytes:
        return b"&".join(
            b"field%d=" % name + b"".join(rnd.choice(ALIKE[u]) for u in value)
            for name, value in fields
        )

    # Another order in which each name's fields keep theirs.
    keys = {name: rnd.random() for name, _ in form}
    reordered = sorted(form, key=lambda field: keys[field[0]])
    assert canonical_form(spelled(form)) == canonical_form(spelled(reordered))


@given(st.binary(max_size=40), st.sampled_from([frozenset(), frozenset({"a", "\xe9"})]))
def test_any_bytes_give_a_canonical_form(body: bytes, excluded: frozenset[str]) -> None:
    assert isinstance(canonical_form(body, excluded), bytes)


needs_multipart = pytest.mark.skipif(
    importlib.util.find_spec("python_multipart") is None,
    reason="Starlette parses forms with python-multipart",
)


def parse_with_starlette(body: bytes) -> list[tuple[str, str]]:
    import asyncio

    from starlette.datastructures import Headers
    from starlette.formparsers import FormParser

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    async def run() -> list[tuple[str, str]]:
        form = await FormParser(Headers({"content-type": FORM}), stream()).parse()
        return [(name, str(value)) for name, value in form.multi_items()]

    return asyncio.run(run())


@st.composite
def spelled_forms(draw: st.DrawFn) -> bytes:
    return b"&".join(spell(draw(forms), draw))


@needs_multipart
@pytest.mark.skipif(
    STARLETTE_VERSION < (1, 10),
    reason="Starlette before 1.10 drops a trailing field without '=': the fingerprint is then "
    "only stricter than the app, never looser",
)
@given(st.binary(max_size=30) | spelled_forms())
def test_the_reference_decoder_is_starlettes(body: bytes) -> None:
    assert starlette_fields(body) == parse_with_starlette(body)
