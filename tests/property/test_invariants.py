"""Property tests: generated requests against the guarded Starlette and FastAPI apps.

The invariants are described and checked in ``tests.support.property.invariants``; a failure
names the invariant, and hypothesis prints the shrunk scenario with every request as it was
sent.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.property.invariants import run_scenario
from tests.support.property.scenarios import (
    concurrent_duplicates,
    confusable_twins,
    content_type_pairs,
    key_variants,
    mixtures,
    sequential_pairs,
    transports,
)
from tests.support.property.settings import PROPERTY_SETTINGS

KINDS = pytest.mark.parametrize("kind", ["starlette", "fastapi"])


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_related_bodies_one_after_another(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(sequential_pairs(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_confusable_values(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(confusable_twins(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_one_body_two_content_types(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(content_type_pairs(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_concurrent_duplicates(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(concurrent_duplicates(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_key_field_lines(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(key_variants(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_chunking_content_length_and_disconnects(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(transports(kind), label="scenario"))


@KINDS
@PROPERTY_SETTINGS
@given(data=st.data())
def test_mixtures(kind: str, data: st.DataObject) -> None:
    run_scenario(data.draw(mixtures(kind), label="scenario"))
