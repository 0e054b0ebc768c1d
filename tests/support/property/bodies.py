"""JSON documents as small trees that render to text in several spellings, and the neighbours
of a document: the same value spelled differently, or a nearby different value.

The number groups are the heart of it: spellings in one group are one value to Python's json
module (``1.0`` and ``10e-1``; ``1e400`` and ``Infinity``), and neighbouring groups are values
that are easy to confuse (``1`` and ``1.0``; ``2**64`` and ``2**64 + 1``; ``NaN`` and
``Infinity``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

NUMBER_GROUPS: tuple[tuple[str, ...], ...] = (
    ("0", "-0"),
    ("0.0", "0e0", "0.00"),
    ("-0.0", "-0e0"),
    ("1",),
    ("1.0", "1.00", "1e0", "1E0", "10e-1", "0.1e1"),
    ("2",),
    ("100",),
    ("100.0", "1e2", "1E+2"),
    ("0.1", "1e-1", "0.10"),
    ("0.30000000000000004",),
    ("9007199254740992",),
    ("9007199254740993",),
    ("9007199254740992.0", "9007199254740993.0"),
    ("9223372036854775807",),
    ("9223372036854775808",),
    ("18446744073709551615",),
    ("18446744073709551616",),
    ("18446744073709551617",),
    ("1.8446744073709552e19", "18446744073709551616.0", "1.8446744073709552E+19"),
    ("-9223372036854775808",),
    ("-9223372036854775809",),
    ("-18446744073709551616",),
    ("-18446744073709551617",),
    ("100000000000000000000000000000",),
    ("100000000000000000000000000001",),
    ("1.7976931348623157e308",),
    ("1e400", "2E400", "Infinity"),
    ("-1e400", "-Infinity"),
    ("NaN",),
    ("5e-324", "4.9e-324", "3e-324"),
)
LITERALS = ("true", "false", "null")
KEYS = (
    "amount",
    "currency",
    "quantity",
    "fee",
    "tags",
    "note",
    "meta",
    "clientTimestamp",
    "ClientTimestamp",
    "nonce",
    "a",
    "é",
    "",
)
STRING_CHARS = st.sampled_from(
    ["a", "b", "Z", " ", "é", "€", "😀", '"', "\\", "/", "\x00", "\n", "\ud800", "\udc00", "\u2028"]
)


@dataclass(frozen=True, slots=True)
class Num:
    group: int
    spelling: int = 0

    def text(self) -> str:
        spellings = NUMBER_GROUPS[self.group]
        return spellings[self.spelling % len(spellings)]


@dataclass(frozen=True, slots=True)
class Lit:
    token: str


@dataclass(frozen=True, slots=True)
class Str:
    value: str


@dataclass(frozen=True, slots=True)
class Arr:
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Obj:
    entries: tuple[tuple[str, Node], ...]


@dataclass(frozen=True, slots=True)
class Nest:
    """``child`` wrapped ``depth`` times in arrays, objects, or both alternately."""

    depth: int
    shape: str
    child: Node


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text written as is (a confusable twin, say)."""

    text: str


Node = Num | Lit | Str | Arr | Obj | Nest | Raw


@dataclass(frozen=True, slots=True)
class Style:
    """How a document is spelled: whitespace, ``\\u`` escapes for non-ASCII, key order."""

    space: str = ""
    ascii_only: bool = False
    reverse_keys: bool = False


def _string(value: str, style: Style) -> str:
    out = ['"']
    for char in value:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif code < 0x20 or 0xD800 <= code <= 0xDFFF or (style.ascii_only and code > 0x7E):
            if code > 0xFFFF:
                code -= 0x10000
                out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
            else:
                out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def render(node: Node, style: Style = Style()) -> str:
    space = style.space
    if isinstance(node, Num):
        return node.text()
    if isinstance(node, Lit):
        return node.token
    if isinstance(node, Raw):
        return node.text
    if isinstance(node, Str):
        return _string(node.value, style)
    if isinstance(node, Arr):
        return "[" + space + ("," + space).join(render(item, style) for item in node.items) + "]"
    if isinstance(node, Obj):
        entries = reversed(node.entries) if style.reverse_keys else node.entries
        parts = [
            _string(name, style) + ":" + space + render(child, style) for name, child in entries
        ]
        return "{" + space + ("," + space).join(parts) + space + "}"
    opening, closing = [], []
    for level in range(node.depth):
        as_array = node.shape == "array" or (node.shape == "mixed" and level % 2 == 0)
        opening.append("[" if as_array else '{"a":')
        closing.append("]" if as_array else "}")
    return "".join(opening) + render(node.child, style) + "".join(reversed(closing))


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


numbers = st.builds(
    Num, st.integers(0, len(NUMBER_GROUPS) - 1), st.integers(0, 5)
) | st.sampled_from(
    [Num(3), Num(4), Num(16), Num(17), Num(18), Num(26), Num(28)]  # the classic confusions
)
leaves: st.SearchStrategy[Node] = st.one_of(
    numbers,
    st.sampled_from(LITERALS).map(Lit),
    st.lists(STRING_CHARS, max_size=6).map(lambda chars: Str("".join(chars))),
)
depths = st.sampled_from([2, 50, 254, 255, 256, 300, 600, 900, 1000]) | st.integers(1, 1000)
nests = st.builds(Nest, depths, st.sampled_from(["array", "object", "mixed"]), leaves)


def _containers(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    return st.one_of(
        st.lists(children, max_size=4).map(lambda items: Arr(tuple(items))),
        st.lists(st.tuples(st.sampled_from(KEYS), children), max_size=4).map(
            lambda entries: Obj(tuple(entries))
        ),
    )


documents: st.SearchStrategy[Node] = st.recursive(
    leaves | nests.filter(lambda nest: nest.depth <= 300), _containers, max_leaves=8
)


INT_GROUPS = tuple(
    index
    for index, group in enumerate(NUMBER_GROUPS)
    if all(isinstance(json.loads(text), int) for text in group)
)
_strings = st.lists(STRING_CHARS, max_size=6).map(lambda chars: Str("".join(chars)))
# Each field as the model accepts it (``typed``) and as anything at all (``loose``).
_PAYMENT_FIELDS: dict[str, tuple[st.SearchStrategy[Node], st.SearchStrategy[Node]]] = {
    "currency": (st.sampled_from(["EUR", "USD", "é", ""]).map(Str), leaves),
    "quantity": (st.builds(Num, st.sampled_from(INT_GROUPS), st.integers(0, 5)), numbers),
    "fee": (numbers | st.just(Lit("null")), leaves),
    "tags": (
        st.lists(st.sampled_from(["x", "y", "😀"]).map(Str), max_size=2).map(
            lambda items: Arr(tuple(items))
        ),
        documents,
    ),
    "note": (_strings | st.just(Lit("null")), leaves),
    "meta": ((documents | nests).map(lambda child: Obj((("x", child),))), documents | nests),
    "clientTimestamp": (numbers, numbers),
    "nonce": (leaves, leaves),
}
_ONE_IN_TEN = st.integers(0, 9)


@st.composite
def _payments(draw: st.DrawFn) -> Node:
    entries: list[tuple[str, Node]] = [("amount", draw(numbers))]
    for name, (typed, loose) in _PAYMENT_FIELDS.items():
        if draw(st.booleans()):
            entries.append((name, draw(loose if draw(_ONE_IN_TEN) == 9 else typed)))
    if draw(_ONE_IN_TEN) == 9:  # a duplicate name: the last one wins
        name, _ = draw(st.sampled_from(entries))
        entries.append((name, draw(leaves)))
    order = draw(st.permutations(range(len(entries))))
    return Obj(tuple(entries[index] for index in order))


#: Objects shaped like the FastAPI routes' ``Payment`` model, mostly valid for it.
payments = _payments()
#: Valid ``Payment`` objects whose ``meta`` nests deeper than orjson writes (254 levels).
deep_payments = st.builds(
    lambda depth, leaf: Obj(
        (("amount", Num(3)), ("meta", Obj((("x", Nest(depth, "object", leaf)),))))
    ),
    st.integers(253, 900),
    leaves,
)


styles = st.builds(
    Style,
    st.sampled_from(["", " ", "\n\t"]),
    st.booleans(),
    st.booleans(),
)


def _leaf_paths(node: Node, path: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if isinstance(node, Arr):
        return [path] + [p for i, c in enumerate(node.items) for p in _leaf_paths(c, (*path, i))]
    if isinstance(node, Obj):
        return [path] + [
            p for i, (_, c) in enumerate(node.entries) for p in _leaf_paths(c, (*path, i))
        ]
    if isinstance(node, Nest):
        return [path, *_leaf_paths(node.child, (*path, 0))]
    return [path]


def _replace(node: Node, path: tuple[int, ...], new: Node) -> Node:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(node, Arr):
        items = list(node.items)
        items[head] = _replace(items[head], rest, new)
        return Arr(tuple(items))
    if isinstance(node, Obj):
        entries = list(node.entries)
        entries[head] = (entries[head][0], _replace(entries[head][1], rest, new))
        return Obj(tuple(entries))
    assert isinstance(node, Nest)
    return Nest(node.depth, node.shape, _replace(node.child, rest, new))


_STEPS = st.sampled_from([-1, 1, 0])
_SPELLINGS = st.integers(0, 5)
_NEAR_LITERALS = st.sampled_from([Lit(token) for token in LITERALS] + [Num(28), Num(26)])
_DEPTH_STEPS = st.sampled_from([-1, 1])
_KEY_NAMES = st.sampled_from(KEYS)


@st.composite
def _neighbour(draw: st.DrawFn, node: Node) -> Node:
    if isinstance(node, Num):
        group = min(max(node.group + draw(_STEPS), 0), len(NUMBER_GROUPS) - 1)
        return Num(group, draw(_SPELLINGS))
    if isinstance(node, Str):
        chars = list(node.value)
        index = draw(st.integers(0, len(chars)))
        chars.insert(index, draw(STRING_CHARS))
        return Str("".join(chars))
    if isinstance(node, Lit | Raw):
        return draw(_NEAR_LITERALS)
    if isinstance(node, Nest):
        return Nest(max(1, node.depth + draw(_DEPTH_STEPS)), node.shape, node.child)
    if isinstance(node, Arr):
        return Arr((*node.items, draw(leaves)))
    return Obj((*node.entries, (draw(_KEY_NAMES), draw(leaves))))


@st.composite
def neighbours(draw: st.DrawFn, node: Node) -> Node:
    """``node`` with one part replaced by a neighbour: often a different value, sometimes the
    same value spelled another way."""
    path = draw(st.sampled_from(_leaf_paths(node)))
    target = node
    for index in path:
        if isinstance(target, Arr):
            target = target.items[index]
        elif isinstance(target, Obj):
            target = target.entries[index][1]
        else:
            assert isinstance(target, Nest)
            target = target.child
    return _replace(node, path, draw(_neighbour(target)))


NON_JSON_BODIES = st.one_of(
    st.sampled_from(
        [
            b"",
            b"amount=1&currency=EUR",
            b"currency=EUR&amount=1",
            b"amount=1.0&currency=EUR",
            b"a=1&a=2",
            b"a=2&a=1",
            b"a=%C3%A9&b=+",
            b"a=\xc3\xa9&b=%20",
            b"clientTimestamp=1&a=1",
            b'--xyz\r\nContent-Disposition: form-data; name="amount"\r\n\r\n1\r\n--xyz--\r\n',
            b'\xef\xbb\xbf{"amount": 1}',  # a BOM: Python's json reads it, orjson does not
            '{"amount": 1}'.encode("utf-16"),  # so is UTF-16
            b"\xff\xfe\x00",
            b"[1,",
            b"NaN",
            b"x" * (16 * 1024 + 1),
        ]
    ),
    st.binary(max_size=24),
)


# Pairs of JSON texts that a canonicaliser may take for one value: most are two values to
# Python's json module (1 and 1.0, 2**64 and 2**64 + 1, NaN and Infinity and null, two lone
# surrogates), a few are one value spelled two ways (-0 and 0, 1e400 and Infinity).
TWINS: tuple[tuple[str, str], ...] = (
    ("1", "1.0"),
    ("0", "-0.0"),
    ("0.0", "-0.0"),
    ("-0", "0"),
    ("18446744073709551616", "18446744073709551617"),
    ("-9223372036854775809", "-9223372036854775810"),
    ("18446744073709551616", "1.8446744073709552e19"),
    ("9007199254740993", "9007199254740992"),
    ("100000000000000000000000000000", "100000000000000000000000000001"),
    ("NaN", "Infinity"),
    ("NaN", "-Infinity"),
    ("NaN", "null"),
    ("Infinity", "null"),
    ("Infinity", "1e400"),
    ("1e400", "1.7976931348623157e308"),
    ('"\\ud800"', '"\\udc00"'),
    ('"\\ud800"', '"\\ufffd"'),
    ('"\\ud83d\\ude00"', '"😀"'),
    ('"é"', '"\\u00e9"'),
    ('"a"', '"a\\u0000"'),
    ("true", "1"),
    ("null", "0"),
    ('"1"', "1"),
)


def _spelled(group: int, spelling: int) -> str:
    return Num(group, spelling).text()


twins = st.one_of(
    st.sampled_from(TWINS),
    st.sampled_from(TWINS),
    st.tuples(
        st.builds(_spelled, st.integers(0, len(NUMBER_GROUPS) - 1), st.integers(0, 5)),
        st.builds(_spelled, st.integers(0, len(NUMBER_GROUPS) - 1), st.integers(0, 5)),
    ),
)
MODEL_FIELDS = ("amount", "fee", "quantity", "note", "meta", "tags")


def place_twin(text: str, *, field: str | None, depth: int = 0, shape: str = "array") -> Node:
    """``text`` in a document: in a ``Payment`` field (``field``), or nested ``depth`` deep."""
    hole: Node = Raw(text)
    if field is None:
        return Nest(depth, shape, hole) if depth else hole
    if field == "meta":
        hole = Obj((("x", hole),))
    elif field == "tags":
        hole = Arr((hole,))
    rest: tuple[tuple[str, Node], ...] = (("amount", Num(3)),) if field != "amount" else ()
    return Obj((*rest, (field, hole)))


@st.composite
def twin_documents(draw: st.DrawFn, model: bool) -> tuple[Node, Node]:
    """Two documents alike but for one spot, where each holds one of a pair of twins."""
    first, second = draw(twins)
    if draw(st.booleans()):
        first, second = second, first
    if model:
        field = draw(st.sampled_from(MODEL_FIELDS))
        return place_twin(first, field=field), place_twin(second, field=field)
    depth = draw(st.sampled_from([0, 1, 2, 300]))
    shape = draw(st.sampled_from(["array", "object", "mixed"]))
    return (
        place_twin(first, field=None, depth=depth, shape=shape),
        place_twin(second, field=None, depth=depth, shape=shape),
    )
