"""Multipart uploads: every client draws a new boundary, so the boundary is not the request;
what Starlette's parser reads apart (names, filenames, content types, contents) is."""

from __future__ import annotations

import tracemalloc
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent
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

    async def stream() -> Any:
        yield body

    headers = Headers({"content-type": content_type(boundary)})
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


def test_a_quoted_boundary_and_a_preamble_are_read() -> None:
    fields: list[Part] = [("a", None, None, b"1")]
    plain = canonical_multipart(encode(fields, "q1"), content_type("q1"))
    quoted = canonical_multipart(
        b"a preamble\r\n" + encode(fields, "q 2"), 'multipart/form-data; boundary="q 2"'
    )
    assert plain is not None
    assert plain == quoted


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
