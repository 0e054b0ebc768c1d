"""JSON values as an app reads them: a hypothesis strategy for any of them (numbers orjson
cannot hold included), and equality as the app sees them."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def same(a: Any, b: Any) -> bool:
    """Equality as the app sees values: 1 and 1.0 differ, so do 0.0 and -0.0; NaN is NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return repr(a) == repr(b)
    return bool(a == b)


big_ints = st.integers(min_value=2**63 - 2, max_value=2**66) | st.integers(
    min_value=-(2**66), max_value=-(2**63) + 2
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | big_ints
    | st.floats()  # NaN, infinities and -0.0 included
    | st.text(st.characters(exclude_categories=()), max_size=6)  # lone surrogates included
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)
