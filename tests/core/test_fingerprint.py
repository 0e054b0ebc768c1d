from __future__ import annotations

import email.message

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers, QueryParams

from starlette_idempotency._fingerprint import (
    canonical_json,
    is_json_content_type,
    raw_body_form,
    request_fingerprint,
)
from starlette_idempotency._keys import split_storage_key, storage_key


def fingerprint(
    body: bytes,
    *,
    content_type: str = "application/json",
    path: str = "/payments",
    query: bytes = b"",
    headers: tuple[tuple[str, str], ...] = (),
    excluded: frozenset[str] = frozenset(),
    method: str = "POST",
) -> str:
    kind, canonical = raw_body_form(body, content_type=content_type, excluded=excluded)
    return request_fingerprint(
        operation="",
        method=method,
        path=path,
        query_string=query,
        headers=headers,
        body_kind=kind,
        body=canonical,
    )


def test_key_order_and_whitespace_do_not_matter() -> None:
    a = fingerprint(b'{"amount":"10.00","currency":"EUR"}')
    b = fingerprint(b'{ "currency": "EUR", "amount": "10.00" }')
    assert a == b
    assert a.startswith("sha256:")
    assert len(a) == len("sha256:") + 64


def test_excluded_fields_at_any_depth_case_insensitive() -> None:
    excluded = frozenset({"clienttimestamp", "requestnonce"})
    a = fingerprint(
        b'{"order":{"items":[{"sku":"a","requestNonce":1}],"ClientTimestamp":5},"x":1}',
        excluded=excluded,
    )
    b = fingerprint(b'{"order":{"items":[{"sku":"a","requestNonce":2}]},"x":1}', excluded=excluded)
    assert a == b
    assert a != fingerprint(b'{"order":{"items":[{"sku":"b"}]},"x":1}', excluded=excluded)


def test_method_path_query_and_headers_take_part() -> None:
    base = fingerprint(b"{}")
    assert fingerprint(b"{}", method="PATCH") != base
    assert fingerprint(b"{}", path="/refunds") != base
    assert fingerprint(b"{}", query=b"a=1") != base
    assert fingerprint(b"{}", headers=(("api-version", "2"),)) != base
    assert fingerprint(b"{}", query=b"b=2&a=1") == fingerprint(b"{}", query=b"a=1&b=2")


def test_invalid_json_is_hashed_as_bytes() -> None:
    assert canonical_json(b"{not json") is None
    # one body under two media types may be two requests to the app
    assert fingerprint(b"{not json") != fingerprint(b"{not json", content_type="text/plain")
    assert fingerprint(b"{not json") != fingerprint(b"{not  json")


def test_other_bodies_are_hashed_as_bytes() -> None:
    text = "text/plain"
    assert fingerprint(b"a=1&b=2", content_type=text) != fingerprint(b"b=2&a=1", content_type=text)
    # the same bytes as JSON and as raw bytes are different requests
    assert fingerprint(b"1", content_type=text) != fingerprint(b"1")
    # a multipart body that is not well-formed (no closing delimiter)
    multipart = "multipart/form-data; boundary=x"
    part = b'--x\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n'
    assert raw_body_form(part, content_type=multipart, excluded=frozenset()) == (
        "bytes;multipart/form-data",
        part,
    )


def test_json_content_types() -> None:
    assert is_json_content_type("application/json")
    assert is_json_content_type("Application/JSON; charset=utf-8")
    assert is_json_content_type("application/merge-patch+json")
    assert not is_json_content_type("application/x-www-form-urlencoded")
    assert not is_json_content_type("")
    # as FastAPI reads them: only application/*, and a media type with one slash
    assert not is_json_content_type("text/x+json")
    assert not is_json_content_type("application/a/b+json")


def fastapi_reads_json(content_type: str) -> bool:
    """FastAPI's own test (fastapi/routing.py, get_request_handler)."""
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


content_type_parts = st.sampled_from(
    ["application", "APPLICATION", "text", "json", "+json", "/", ";", " ", "\t", "a", "\xa0"]
)


@given(st.lists(content_type_parts, max_size=8).map("".join) | st.text(max_size=30))
def test_json_content_types_are_fastapis(content_type: str) -> None:
    content_type = content_type.replace("\r", "").replace("\n", "")
    assert is_json_content_type(content_type) == fastapi_reads_json(content_type)


def test_storage_key_is_injective() -> None:
    assert storage_key("a:b", "POST", "/p", "c") != storage_key("a", "POST", "/p", "b:c")
    assert storage_key("", "POST", "/p", "a%3Ab") != storage_key("", "POST", "/p", "a:b")
    key = storage_key("t", "POST", "/members/{member_id}", "{k}")
    assert "{" not in key
    assert "}" not in key
    assert key.count(":") == 3


key_parts = st.text(alphabet=st.sampled_from("ab:%{}3A7BD/"), max_size=6) | st.text(max_size=6)


@given(st.tuples(key_parts, key_parts, key_parts, key_parts))
def test_storage_key_gives_back_its_parts(parts: tuple[str, str, str, str]) -> None:
    # One key per tuple of parts, with or without characters to escape.
    key = storage_key(*parts)
    assert split_storage_key(key) == parts
    assert key.count(":") == 3
    assert "{" not in key
    assert "}" not in key


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=5)


@given(json_objects, st.randoms(use_true_random=False), st.sampled_from([None, 1, 2]))
def test_encoding_never_changes_the_fingerprint(
    value: dict[str, object], rnd: object, indent: int | None
) -> None:
    items = list(value.items())
    rnd.shuffle(items)  # type: ignore[attr-defined]
    reordered = dict(items)
    compact = orjson.dumps(value)
    spaced = orjson.dumps(reordered, option=orjson.OPT_INDENT_2 if indent else 0)
    assert fingerprint(compact) == fingerprint(spaced)


@given(json_objects, st.data())
def test_changing_a_value_always_changes_the_fingerprint(
    value: dict[str, object], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(value)))
    new_value = data.draw(
        json_values.filter(lambda v: v != value[name] or type(v) is not type(value[name]))
    )
    changed = {**value, name: new_value}
    assert fingerprint(orjson.dumps(value)) != fingerprint(orjson.dumps(changed))


@given(json_objects, st.data())
def test_changing_an_excluded_value_never_changes_the_fingerprint(
    value: dict[str, object], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(value)))
    excluded = frozenset({name.lower()})
    changed = {**value, name: data.draw(json_values)}
    assert fingerprint(orjson.dumps(value), excluded=excluded) == fingerprint(
        orjson.dumps(changed), excluded=excluded
    )


def test_repeated_query_parameters_and_headers_keep_their_order() -> None:
    # Starlette's query_params.get() takes the last value and getlist() keeps the order, so
    # "?id=1&id=2" and "?id=2&id=1" are two requests to the app; other names may move.
    assert fingerprint(b"{}", query=b"id=1&id=2") != fingerprint(b"{}", query=b"id=2&id=1")
    assert fingerprint(b"{}", query=b"id=1&x=0&id=2") == fingerprint(b"{}", query=b"x=0&id=1&id=2")
    first, second = ("x-api-version", "1"), ("x-api-version", "2")
    other = ("x-tenant", "t")
    assert fingerprint(b"{}", headers=(first, second)) != fingerprint(
        b"{}", headers=(second, first)
    )
    assert fingerprint(b"{}", headers=(first, other, second)) == fingerprint(
        b"{}", headers=(other, first, second)
    )


_names = st.sampled_from(["a", "b", "A", "%61", "a b", "é"])
_values = st.sampled_from(["", "1", "2", "x y", "%2B", "+"])
_pairs = st.lists(st.tuples(_names, _values), max_size=6)


@given(pairs=_pairs, data=st.data())
def test_query_fingerprints_follow_what_starlette_reads(
    pairs: list[tuple[str, str]], data: st.DataObject
) -> None:
    """Two orders of the same query parameters share a fingerprint exactly when Starlette's
    ``QueryParams`` gives every name the same list of values in both."""
    other = data.draw(st.permutations(pairs))

    def raw(items: list[tuple[str, str]]) -> bytes:
        return "&".join(f"{name}={value}" for name, value in items).encode()

    def seen(items: list[tuple[str, str]]) -> dict[str, list[str]]:
        params = QueryParams(raw(items))
        return {name: params.getlist(name) for name in params}

    same = fingerprint(b"{}", query=raw(pairs)) == fingerprint(b"{}", query=raw(other))
    assert same == (seen(pairs) == seen(other))


@given(
    headers=st.lists(
        st.tuples(st.sampled_from(["x-api-version", "x-tenant"]), st.sampled_from("123")),
        max_size=5,
    ),
    data=st.data(),
)
def test_header_fingerprints_follow_what_starlette_reads(
    headers: list[tuple[str, str]], data: st.DataObject
) -> None:
    """Two orders of the chosen headers share a fingerprint exactly when Starlette's
    ``Headers.getlist`` gives every name the same values in both."""
    other = data.draw(st.permutations(headers))

    def seen(items: list[tuple[str, str]]) -> dict[str, list[str]]:
        view = Headers(raw=[(name.encode(), value.encode()) for name, value in items])
        return {name: view.getlist(name) for name, _ in items}

    same = fingerprint(b"{}", headers=tuple(headers)) == fingerprint(b"{}", headers=tuple(other))
    assert same == (seen(headers) == seen(other))


MULTIPART = (
    b'--b1\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n'
    b'--b1\r\nContent-Disposition: form-data; name="nonce"\r\n\r\n2\r\n--b1--\r\n'
)


@pytest.mark.parametrize(
    ("body", "content_type", "pinned"),
    [
        (
            b'{"b": 1, "a": [1.5, "x"], "nonce": 7}',
            "application/json",
            "843da9736cbc74bee7466b1e5a88b49ced76b8ff16bf37278a46ee5f1bbb06a1",
        ),
        (
            b'{"items": [NaN], "nonce": 1}',
            "application/json",
            "a006163985d349d97dfed824a3e956ccef7d9cdbe1eb188c8a1c078437ba342f",
        ),
        (
            b'\xef\xbb\xbf{"items": [1], "nonce": 2}',
            "application/json",
            "44c72fc2a02a8922baf80d8e1b0355d52770362338736e85019e70f3530a7c45",
        ),
        (
            b'{"items": [18446744073709551616], "nonce": 1}',
            "application/json",
            "c9286d93b396b822045b3fd536aabcc945b0a26a877318fc1df01f6d40d8e6f2",
        ),
        (
            b"nonce=1&b=2&a=1",
            "application/x-www-form-urlencoded",
            "07facc25cfb75a7035c003ae6c63a763fda2f1ab6defee67a6d7072e7c6be593",
        ),
        (
            MULTIPART,
            "multipart/form-data; boundary=b1; charset=latin-1",
            "b3c0244da41a39a277a1345a53c10f06bc07cf7f0fb79a3914b93eb4479380bf",
        ),
        (
            b"plain",
            "text/plain",
            "3b2727808e58979fc8df90ff887d4c99188fd16873e224fe1d29b60172837019",
        ),
    ],
)
def test_fingerprints_stay_those_of_stored_records(
    body: bytes, content_type: str, pinned: str
) -> None:
    """A record stored under scheme 4 must still match its retry: a change to what these
    hash to needs a new FINGERPRINT_SCHEME."""
    found = fingerprint(body, content_type=content_type, path="/p", excluded=frozenset({"nonce"}))
    assert found == "sha256:" + pinned
