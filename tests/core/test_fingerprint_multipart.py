"""Multipart uploads: every client draws a new boundary, so the boundary is not the request;
what Starlette's parser reads apart (names, filenames, content types, contents) is."""

from __future__ import annotations

import hashlib
import tracemalloc
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, _fingerprint, idempotent
from starlette_idempotency._fingerprint import canonical_multipart, raw_body_form
from tests.support.guarded import make_client

Part = tuple[str, str | None, str | None, bytes]


def encode(parts: list[Part], boundary: str) -> bytes:
    """A multipart/form-data body as clients write it (name, filename, type, content)."""
    out = []
    for name, filename, content_type, content in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        head = f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
        if content_type is not None:
            head += f"Content-Type: {content_type}\r\n"
        out.append(head.encode() + b"\r\n" + content + b"\r\n")
    return b"".join(out) + f"--{boundary}--\r\n".encode()


def content_type(boundary: str) -> str:
    return f"multipart/form-data; boundary={boundary}"


async def starlette_reads(body: bytes, boundary: str) -> list[tuple[str, Any]]:
    """What Starlette's parser makes of a body: the fields as the app reads them."""
    return await starlette_reads_as(body, content_type(boundary))


async def starlette_reads_as(body: bytes, sent_type: str) -> list[tuple[str, Any]]:
    async def stream() -> Any:
        yield body

    headers = Headers({"content-type": sent_type})
    form = await MultiPartParser(headers, stream()).parse()
    read: list[tuple[str, Any]] = []
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            read.append((name, (value.filename, value.content_type, await value.read())))
        else:
            read.append((name, value))
    await form.close()
    return read


names = st.sampled_from(["a", "file", "note", "b"])
parts = st.lists(
    st.tuples(
        names,
        st.none() | st.sampled_from(["a.txt", "b.txt"]),
        st.none() | st.sampled_from(["text/plain", "application/pdf"]),
        st.binary(max_size=30).filter(lambda b: b"--" not in b),
    ),
    max_size=4,
)
boundaries = st.text("abcdefXYZ0123456789-", min_size=8, max_size=30).map(lambda b: "b" + b)


@given(parts, boundaries, boundaries)
def test_the_boundary_is_not_part_of_the_request(
    fields: list[Part], first: str, second: str
) -> None:
    one = canonical_multipart(encode(fields, first), content_type(first))
    other = canonical_multipart(encode(fields, second), content_type(second))
    assert one is not None
    assert one == other


@given(parts, parts, boundaries)
async def test_what_starlette_reads_apart_never_shares_a_form(
    first: list[Part], second: list[Part], boundary: str
) -> None:
    bodies = [encode(fields, boundary) for fields in (first, second)]
    forms = [canonical_multipart(body, content_type(boundary)) for body in bodies]
    if await starlette_reads(bodies[0], boundary) != await starlette_reads(bodies[1], boundary):
        assert forms[0] != forms[1]


def test_excluded_fields_are_left_out_by_name() -> None:
    fields: list[Part] = [("amount", None, None, b"1"), ("Nonce", None, None, b"x")]
    changed: list[Part] = [("amount", None, None, b"1"), ("Nonce", None, None, b"y")]
    excluded = frozenset({"nonce"})
    assert canonical_multipart(encode(fields, "b1"), content_type("b1"), excluded) == (
        canonical_multipart(encode(changed, "b2"), content_type("b2"), excluded)
    )
    assert canonical_multipart(encode(fields, "b1"), content_type("b1")) != (
        canonical_multipart(encode(changed, "b2"), content_type("b2"))
    )


@pytest.mark.parametrize(
    ("body", "boundary_param"),
    [
        (b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n", "boundary=x"),  # no end
        (b"--x\r\n Content-Disposition: form-data\r\n\r\n1\r\n--x--", "boundary=x"),  # folded
        (b"--x\r\nno colon here\r\n\r\n1\r\n--x--", "boundary=x"),
        (b"--x junk\r\n\r\n1\r\n--x--", "boundary=x"),
        (b"no delimiter at all", "boundary=x"),
        (b"--x\r\n\r\n1\r\n--x--", ""),  # no boundary parameter
    ],
)
def test_what_is_not_multipart_is_compared_byte_for_byte(body: bytes, boundary_param: str) -> None:
    media = f"multipart/form-data; {boundary_param}"
    assert raw_body_form(body, content_type=media, excluded=frozenset()) == (
        "bytes;multipart/form-data",
        body,
    )


def test_a_quoted_boundary_is_read() -> None:
    fields: list[Part] = [("a", None, None, b"1")]
    plain = canonical_multipart(encode(fields, "q1"), content_type("q1"))
    quoted = canonical_multipart(encode(fields, "q 2"), 'multipart/form-data; boundary="q 2"')
    assert plain is not None
    assert plain == quoted


def test_a_preamble_and_an_epilogue_count() -> None:
    """Parsers skip them, but a parser that reads the boundary otherwise finds its parts
    there; what clients send (nothing, or a line break after the end) is as before."""
    body = encode([("a", None, None, b"1")], "e1")
    plain = canonical_multipart(body, content_type("e1"))
    assert plain == b'[[[["content-disposition","form-data; name=\\"a\\""]],"%s"]]' % (
        hashlib.sha256(b"1").hexdigest().encode()
    )
    assert canonical_multipart(body.removesuffix(b"\r\n"), content_type("e1")) == plain
    assert canonical_multipart(b"\r\n" + body, content_type("e1")) == plain
    padded = [b"a preamble\r\n" + body, body + b"an epilogue", body + b"\r\n"]
    forms = {canonical_multipart(one, content_type("e1")) for one in [body, *padded]}
    assert None not in forms
    assert len(forms) == 4


def encode_as(parts: list[tuple[str, bytes]], boundary: str) -> bytes:
    """Fields (Content-Disposition, content) under ``boundary``."""
    out = [
        f"--{boundary}\r\nContent-Disposition: {head}\r\n\r\n".encode() + content + b"\r\n"
        for head, content in parts
    ]
    return b"".join(out) + f"--{boundary}--\r\n".encode()


# Content types whose boundary python-multipart reads otherwise than a first glance: the last
# of two, the one outside quotes, a quoted-pair unescaped. Each as (header, read, decoy).
TRICKY_BOUNDARIES = [
    ("boundary=decoy; boundary=real", "real", "decoy"),
    ('x="; boundary=decoy"; boundary=real', "real", 'decoy"'),
    ('boundary="re\\\\al"', "re\\al", "re\\\\al"),
]
# Dispositions whose name python-multipart reads otherwise: a name= in another parameter's
# quotes, a second Content-Disposition header.
TRICKY_NAMES = [
    'form-data; name="{}"',
    'form-data; x="; name=nonce;"; name="{}"',
    'form-data; name="nonce"\r\nContent-Disposition: form-data; name="{}"',
]
fields = st.lists(
    st.tuples(
        st.sampled_from(TRICKY_NAMES), st.sampled_from(["amount", "nonce"]), st.binary(max_size=3)
    ),
    min_size=1,
    max_size=3,
)


@pytest.fixture(params=["python-multipart", "without python-multipart"])
def parameter_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Either reader of parameters: python-multipart's, or the one used without it."""
    if request.param != "python-multipart":
        monkeypatch.setattr(_fingerprint, "_read_options", None)
        monkeypatch.setattr(_fingerprint, "_MEDIA_TYPES", {})


@pytest.mark.usefixtures("parameter_reader")
@given(fields, fields, st.sampled_from(TRICKY_BOUNDARIES))
@example(
    [('form-data; name="{}"', "amount", b"10")],
    [('form-data; name="{}"', "amount", b"99")],
    TRICKY_BOUNDARIES[0],
)
@example(
    [('form-data; x="; name=nonce;"; name="{}"', "amount", b"10")],
    [('form-data; x="; name=nonce;"; name="{}"', "amount", b"99")],
    TRICKY_BOUNDARIES[0],
)
async def test_parameters_are_read_as_starlette_reads_them(
    first: list[tuple[str, str, bytes]],
    second: list[tuple[str, str, bytes]],
    boundaries: tuple[str, str, str],
) -> None:
    """Bodies whose parts Starlette reads apart (the excluded field aside) under a content
    type it reads otherwise than a first glance never share a form; a part under the boundary
    a first glance takes lies in the epilogue, which parsers skip."""
    header, read, decoy = boundaries
    sent_type = f"multipart/form-data; {header}"
    decoy_part = encode_as([('form-data; name="amount"', b"1")], decoy)
    bodies = [
        encode_as([(head.format(name), content) for head, name, content in parts], read)
        + b"\r\n"
        + decoy_part
        for parts in (first, second)
    ]
    reads = [
        [
            (name, value)
            for name, value in await starlette_reads_as(body, sent_type)
            if name != "nonce"
        ]
        for body in bodies
    ]
    forms = [
        raw_body_form(body, content_type=sent_type, excluded=frozenset({"nonce"}))
        for body in bodies
    ]
    if reads[0] != reads[1]:
        assert forms[0] != forms[1]


@pytest.mark.parametrize(
    "header",
    ["boundary=a; boundary=b", 'x="; boundary=a"', 'boundary="a\\\\b"', "boundary=a\\b"],
)
def test_without_python_multipart_a_boundary_parsers_may_read_apart_is_not_read(
    header: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_fingerprint, "_read_options", None)
    body = encode([("a", None, None, b"1")], "a")
    sent_type = f"multipart/form-data; {header}"
    assert raw_body_form(body, content_type=sent_type, excluded=frozenset())[0] == (
        "bytes;multipart/form-data"
    )


def test_without_python_multipart_a_name_parsers_may_read_apart_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_fingerprint, "_read_options", None)
    disposition = 'form-data; x="; name=nonce;"; name="nonce"'
    body = encode_as([(disposition, b"1")], "n1")
    assert canonical_multipart(body, content_type("n1"), frozenset({"nonce"})) != b"[]"


@pytest.mark.usefixtures("parameter_reader")
def test_a_well_formed_body_is_read_alike_by_either_reader() -> None:
    fields: list[Part] = [("a", None, None, b"1"), ("nonce", "n.txt", "text/plain", b"2")]
    body = encode(fields, "w1")
    form = raw_body_form(body, content_type=content_type("w1"), excluded=frozenset({"nonce"}))
    assert form == ("multipart", canonical_multipart(encode(fields[:1], "w2"), content_type("w2")))


def test_large_parts_are_hashed_where_they_lie() -> None:
    content = b"\x00" * (32 * 1024 * 1024)
    body = encode([("file", "big.bin", "application/octet-stream", content)], "big")
    tracemalloc.start()
    try:
        assert canonical_multipart(body, content_type("big")) is not None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, f"{peak} bytes allocated for a 32 MiB part"


runs: Counter[str] = Counter()


@idempotent(exclude_fields=["nonce"])
async def upload(request: Request) -> Response:
    async with request.form() as form:
        file = form["file"]
        assert isinstance(file, UploadFile)
        size = len(await file.read())
    runs["upload"] += 1
    return JSONResponse({"run": runs["upload"], "size": size}, status_code=201)


async def test_a_retried_upload_is_replayed_whatever_boundary_the_client_draws() -> None:
    app = Starlette(routes=[Route("/uploads", upload, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), max_body_bytes=4 * 1024 * 1024)
    client = make_client(app)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    files = {"file": ("report.pdf", b"%PDF-1.7 " * 1000, "application/pdf")}
    first = await client.post("/uploads", files=files, data={"nonce": "1"}, headers=headers)
    retry = await client.post("/uploads", files=files, data={"nonce": "2"}, headers=headers)
    assert first.status_code == 201, first.text
    assert retry.headers.get("x-idempotent-replay") == "true"
    assert retry.json() == first.json()
    other = {"file": ("report.pdf", b"%PDF-1.7 other", "application/pdf")}
    assert (await client.post("/uploads", files=other, headers=headers)).status_code == 422
    renamed = {"file": ("copy.pdf", b"%PDF-1.7 " * 1000, "application/pdf")}
    assert (await client.post("/uploads", files=renamed, headers=headers)).status_code == 422
    assert runs["upload"] == 1


@idempotent()
async def note(request: Request) -> Response:
    async with request.form() as form:
        runs["note"] += 1
        return JSONResponse({"note": form["note"]}, status_code=201)


async def test_a_charset_that_changes_what_the_app_reads_is_another_request() -> None:
    """The same bytes under ``charset=latin-1`` are other field values to Starlette's parser:
    a 422, never the UTF-8 request's answer; ``charset=utf-8`` is what no charset means."""
    app = Starlette(routes=[Route("/notes", note, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore())
    client = make_client(app)
    body = encode([("note", None, None, "café".encode())], "c1")
    kinds = [content_type("c1"), content_type("c1") + "; charset=latin-1"]
    read = [
        await client.post(
            "/notes",
            content=body,
            headers={"content-type": kind, "Idempotency-Key": uuid.uuid4().hex},
        )
        for kind in kinds
    ]
    assert [answer.json() for answer in read] == [{"note": "café"}, {"note": "cafÃ©"}]
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    first = await client.post("/notes", content=body, headers={**headers, "content-type": kinds[0]})
    assert first.status_code == 201, first.text
    same = content_type("c1") + '; charset="UTF-8"'
    retry = await client.post("/notes", content=body, headers={**headers, "content-type": same})
    assert retry.headers.get("x-idempotent-replay") == "true"
    latin = await client.post("/notes", content=body, headers={**headers, "content-type": kinds[1]})
    assert latin.status_code == 422, latin.text


@pytest.mark.parametrize(
    ("sent", "kind"),
    [
        ("text/plain", "bytes;text/plain"),
        ("text/plain; charset=utf-8", "bytes;text/plain"),
        ("text/plain; charset=UTF8", "bytes;text/plain"),
        ("text/plain; charset=latin-1", "bytes;text/plain;charset=iso8859-1"),
        ('text/plain; charset="ISO-8859-1"', "bytes;text/plain;charset=iso8859-1"),
        ("text/plain; charset=no-such-codec", "bytes;text/plain;charset=no-such-codec"),
        ("application/x-www-form-urlencoded", "form"),
        ("application/x-www-form-urlencoded; charset=cp1252", "form;charset=cp1252"),
        ("application/json; charset=latin-1", "json"),
    ],
)
def test_a_charset_other_than_utf_8_follows_the_kind(sent: str, kind: str) -> None:
    """Without a charset (or with UTF-8) the kinds, and so the fingerprints, are those of
    before; JSON is read from its bytes, whatever the charset says."""
    body = b'{"a": 1}' if "json" in sent else b"a=1"
    assert raw_body_form(body, content_type=sent, excluded=frozenset())[0] == kind


def test_a_multipart_charset_follows_its_kind() -> None:
    body = encode([("a", None, None, b"1")], "k1")
    for charset, kind in [("", "multipart"), ("; charset=latin-1", "multipart;charset=iso8859-1")]:
        media = content_type("k1") + charset
        assert raw_body_form(body, content_type=media, excluded=frozenset())[0] == kind


async def test_the_multipart_charset_is_the_one_starlette_reads() -> None:
    """Which of two charsets applies, the one in quotes or out, is python-multipart's call."""
    body = encode([("note", None, None, "café".encode())], "k2")
    sent_types = [
        content_type("k2") + '; charset=latin-1; x="; charset=utf-8"',
        content_type("k2") + '; x="; charset=latin-1"; charset=utf-8',
    ]
    reads = [await starlette_reads_as(body, sent_type) for sent_type in sent_types]
    assert reads == [[("note", "cafÃ©")], [("note", "café")]]
    kinds = [raw_body_form(body, content_type=sent, excluded=frozenset())[0] for sent in sent_types]
    assert kinds == ["multipart;charset=iso8859-1", "multipart"]
