"""Hypothesis strategies for keys, requests and whole scenarios."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from tests.support.property.apps import ROUTES, MiddlewareOptions, RouteInfo
from tests.support.property.bodies import (
    NON_JSON_BODIES,
    Node,
    deep_payments,
    documents,
    encode,
    neighbours,
    nests,
    payments,
    render,
    styles,
    twin_documents,
)
from tests.support.property.driver import ContentLength, Disconnect, RequestSpec
from tests.support.property.invariants import Scenario

BASE_KEYS = (b"k", b"k1", b"k2", b"8e03978e-40d5")
VISIBLE = "".join(chr(code) for code in range(0x21, 0x7F))

valid_keys = st.one_of(
    st.sampled_from(BASE_KEYS),
    st.sampled_from(BASE_KEYS).map(lambda key: b'"' + key + b'"'),
    st.text(VISIBLE, min_size=1, max_size=8).map(str.encode),
)
key_values = st.one_of(
    valid_keys,
    st.sampled_from(
        [
            b"",
            b'""',
            b" ",
            b" k1 ",
            b"\tk1",
            b"k1,k2",
            b"k1, k2",
            b"k,",
            b'"k1","k2"',
            b'"k1, k2"',
            b'"a b"',
            b'"k\\"1"',
            b'"k\\\\"',
            b'"k\\n"',
            b'"k1',
            b'"k1" ',
            b'"k1";p=1',
            b'"k"1"',
            b"k\xc3\xa9",
            b"\xff",
            b"k\x00",
            b"k\x7f",
            b"k 1",
            b"k" * 255,
            b"k" * 256,
            b'"' + b"k" * 255 + b'"',
            b'"' + b"k" * 256 + b'"',
        ]
    ),
    st.binary(min_size=1, max_size=6),
)
JSON_TYPES = (
    b"application/json",
    b"application/json; charset=utf-8",
    b"APPLICATION/JSON",
    b"application/vnd.api+json",
    b"application/problem+json",
)
OTHER_TYPES = (
    None,
    b"text/plain",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=xyz",
    b"application/octet-stream",
    b"text/json",
    b"text/vnd.x+json",
    b"application/jsonx",
)
content_types = st.sampled_from(JSON_TYPES[:1] * 4 + JSON_TYPES + OTHER_TYPES)
# Field lines after the usual ones: a second Content-Type (the app reads the first), a second
# Content-Length, a header nobody reads.
extra_headers = st.sampled_from(
    [
        ((b"content-type", b"application/json"),),
        ((b"content-type", b"text/plain"),),
        ((b"content-length", b"0"),),
        ((b"x-request-id", b"r1"),),
    ]
)


# Mostly 409 for a duplicate in flight; sometimes the duplicate waits for the first's answer.
middleware_options = st.sampled_from(
    [MiddlewareOptions("conflict"), MiddlewareOptions("conflict"), MiddlewareOptions("wait")]
)


# Strategies are built once: building one inside a composite on every draw costs more than
# the draw, and the shrinker draws thousands of times.
_ROUTES = {kind: st.sampled_from(routes) for kind, routes in ROUTES.items()}
_PATHS = {route: st.sampled_from(route.paths) for routes in ROUTES.values() for route in routes}
_MODEL_BODIES: st.SearchStrategy[Node] = payments | documents
_OTHER_BODIES: st.SearchStrategy[Node] = documents | nests | payments
_CUTS = st.lists(st.integers(0, 1 << 16), max_size=4)
_PAUSES = st.integers(0, 3)
_CONTENT_LENGTHS: st.SearchStrategy[ContentLength] = st.sampled_from(
    ["exact", "absent", "garbage", "huge"]
)
_DISCONNECTS: st.SearchStrategy[Disconnect] = st.sampled_from(
    ["none", "none", "mid_body", "after_body"]
)
_ONE_IN = {n: st.integers(0, n - 1) for n in (3, 4, 5)}
_FRAMED_BODIES = {True: _MODEL_BODIES | deep_payments, False: _OTHER_BODIES}
_ONE_TO_THREE = st.integers(1, 3)
_RELATIONS = st.sampled_from(["same", "respelled", "neighbour", "neighbour", "other"])
_CROWD_TYPES = st.sampled_from(JSON_TYPES[:1] * 3 + (None, b"text/plain"))
_CROWD_SIZES = st.integers(2, 6)
_KEY_SHAPES = st.sampled_from(["one", "one", "one", "none", "two"])
_OTHER_METHODS = ["PATCH", "PUT", "GET"]
_TWIN_TYPES = st.sampled_from(JSON_TYPES[:1] * 4 + JSON_TYPES[1:] + (b"text/plain",))


def _one_in(draw: st.DrawFn, n: int) -> bool:
    """True about once in ``n`` draws; shrinks to False."""
    return draw(_ONE_IN[n]) == n - 1


def routes(kind: str) -> st.SearchStrategy[RouteInfo]:
    return _ROUTES[kind]


def json_bodies(route: RouteInfo) -> st.SearchStrategy[Node]:
    return _MODEL_BODIES if route.model else _OTHER_BODIES


@st.composite
def specs(
    draw: st.DrawFn,
    route: RouteInfo,
    body: bytes,
    *,
    keys: tuple[bytes, ...],
    content_type: bytes | None,
    lively: bool = False,
) -> RequestSpec:
    """A request to ``route``; ``lively`` ones also get pauses inside the endpoint, a
    Content-Length that may lie and a client that may leave."""
    spec = RequestSpec(
        method=route.methods[0],
        path=draw(_PATHS[route]),
        key_values=keys,
        content_type=content_type,
        body=body,
    )
    if lively or _one_in(draw, 3):
        cuts = tuple(cut % (len(body) + 1) for cut in draw(_CUTS))
        spec = replace(spec, cuts=cuts, pauses=draw(_PAUSES))
    if _one_in(draw, 5):
        spec = replace(spec, extra_headers=draw(extra_headers))
    if lively:
        spec = replace(
            spec,
            handler_pauses=draw(_PAUSES),
            content_length=draw(_CONTENT_LENGTHS),
            disconnect=draw(_DISCONNECTS),
        )
    return spec


@st.composite
def related_bodies(draw: st.DrawFn, route: RouteInfo) -> tuple[bytes, list[bytes]]:
    """A first body and follow-ups: the same bytes, the same value spelled another way, a
    neighbouring value, or something else entirely."""
    document = draw(json_bodies(route))
    first = encode(render(document, draw(styles)))
    follow_ups = []
    for _ in range(draw(_ONE_TO_THREE)):
        relation = draw(_RELATIONS)
        if relation == "same":
            follow_ups.append(first)
        elif relation == "respelled":
            follow_ups.append(encode(render(document, draw(styles))))
        elif relation == "neighbour":
            follow_ups.append(encode(render(draw(neighbours(document)), draw(styles))))
        else:
            follow_ups.append(encode(render(draw(json_bodies(route)), draw(styles))))
    return first, follow_ups


@st.composite
def sequential_pairs(draw: st.DrawFn, kind: str) -> Scenario:
    """One key, a first request and follow-ups with related bodies, one after another."""
    route = draw(routes(kind))
    key = (draw(valid_keys),)
    first, follow_ups = draw(related_bodies(route))
    content_type = draw(content_types)
    waves = [(draw(specs(route, first, keys=key, content_type=content_type)),)]
    for body in follow_ups:
        follow_type = draw(content_types) if _one_in(draw, 4) else content_type
        waves.append((draw(specs(route, body, keys=key, content_type=follow_type)),))
    return Scenario(kind, tuple(waves))


@st.composite
def concurrent_duplicates(draw: st.DrawFn, kind: str) -> Scenario:
    """Several requests with one key at once, interleaved by pauses, then a late retry."""
    route = draw(routes(kind))
    key = (draw(valid_keys),)
    first, follow_ups = draw(related_bodies(route))
    bodies = [first, *follow_ups]
    content_type = draw(_CROWD_TYPES)
    crowd = [
        draw(
            specs(
                route,
                draw(st.sampled_from(bodies)),
                keys=key,
                content_type=content_type,
                lively=True,
            )
        )
        for _ in range(draw(_CROWD_SIZES))
    ]
    crowd = [replace(spec, disconnect="none", content_length="exact") for spec in crowd]
    waves = [tuple(crowd)]
    if draw(st.booleans()):
        waves.append((draw(specs(route, first, keys=key, content_type=content_type)),))
    return Scenario(kind, tuple(waves), draw(middleware_options))


@st.composite
def key_variants(draw: st.DrawFn, kind: str) -> Scenario:
    """Well-formed and malformed key field lines (none, one, two) around one body."""
    route = draw(routes(kind))
    body = encode(render(draw(payments)))
    pool = draw(st.lists(key_values, min_size=1, max_size=3))
    waves = []
    for _ in range(draw(_ONE_TO_THREE)):
        shape = draw(_KEY_SHAPES)
        if shape == "none":
            keys: tuple[bytes, ...] = ()
        elif shape == "one":
            keys = (draw(st.sampled_from(pool)),)
        else:
            keys = (draw(st.sampled_from(pool)), draw(st.sampled_from(pool)))
        method = draw(st.sampled_from([route.methods[0]] * 3 + _OTHER_METHODS))
        spec = draw(specs(route, body, keys=keys, content_type=b"application/json"))
        waves.append((replace(spec, method=method),))
    return Scenario(kind, tuple(waves))


@st.composite
def transports(draw: st.DrawFn, kind: str) -> Scenario:
    """Chunked bodies, Content-Length that lies, clients that leave; then a clean retry."""
    route = draw(routes(kind))
    key = (draw(valid_keys),)
    if draw(st.booleans()):
        body = encode(render(draw(json_bodies(route)), draw(styles)))
    else:
        body = draw(NON_JSON_BODIES)
    content_type = draw(content_types)
    first = draw(specs(route, body, keys=key, content_type=content_type, lively=True))
    retry = draw(specs(route, body, keys=key, content_type=content_type))
    together = draw(st.booleans())
    waves = [(first, retry)] if together else [(first,), (retry,)]
    return Scenario(kind, tuple(waves))


@st.composite
def mixtures(draw: st.DrawFn, kind: str) -> Scenario:
    """Anything with anything: routes, methods, keys, bodies and content types from small
    pools, so that keys and bodies meet each other in every combination."""
    key_pool = draw(st.lists(valid_keys | key_values, min_size=1, max_size=2))
    body_pool = draw(
        st.lists(
            st.one_of(
                documents.map(render).map(encode),
                payments.map(render).map(encode),
                NON_JSON_BODIES,
            ),
            min_size=1,
            max_size=3,
        )
    )
    waves = []
    for _ in range(draw(_ONE_TO_THREE)):
        wave = []
        for _ in range(draw(_ONE_TO_THREE)):
            route = draw(routes(kind))
            spec = draw(
                specs(
                    route,
                    draw(st.sampled_from(body_pool)),
                    keys=(draw(st.sampled_from(key_pool)),),
                    content_type=draw(content_types),
                    lively=_one_in(draw, 4),
                )
            )
            method = draw(st.sampled_from((*route.methods, "POST")))
            wave.append(replace(spec, method=method))
        waves.append(tuple(wave))
    return Scenario(kind, tuple(waves), draw(middleware_options))


@st.composite
def confusable_twins(draw: st.DrawFn, kind: str) -> Scenario:
    """One key, two bodies alike but for a value a canonicaliser may confuse with another
    (``1`` and ``1.0``, ``2**64`` and ``2**64 + 1``, ``NaN`` and ``null``), one after the
    other or at once, and then the first again."""
    route = draw(routes(kind))
    key = (draw(valid_keys),)
    first, second = draw(twin_documents(route.model))
    style = draw(styles)
    content_type = draw(_TWIN_TYPES)
    bodies = [encode(render(first, style)), encode(render(second, style))]
    requests = [draw(specs(route, body, keys=key, content_type=content_type)) for body in bodies]
    together = _one_in(draw, 4)
    waves = [tuple(requests)] if together else [(request,) for request in requests]
    if draw(st.booleans()):
        waves.append((requests[0],))
    return Scenario(kind, tuple(waves))


@st.composite
def content_type_pairs(draw: st.DrawFn, kind: str) -> Scenario:
    """One key and one body sent twice, framed differently: another Content-Type (or none),
    a second Content-Type line. The app may read the two apart (FastAPI reads only JSON media
    types as JSON, and only the first line), so the second must not get the first's replay
    unless the app would answer it the same."""
    route = draw(routes(kind))
    key = (draw(valid_keys),)
    if _one_in(draw, 3):
        body = draw(NON_JSON_BODIES)
    else:
        body = encode(render(draw(_FRAMED_BODIES[route.model]), draw(styles)))
    framings = [
        draw(specs(route, body, keys=key, content_type=draw(content_types))) for _ in range(2)
    ]
    together = _one_in(draw, 4)
    waves = [tuple(framings)] if together else [(framing,) for framing in framings]
    return Scenario(kind, tuple(waves))
