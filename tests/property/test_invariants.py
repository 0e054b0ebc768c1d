"""Property tests: generated requests against the guarded Starlette and FastAPI apps.

The invariants are described and checked in ``tests.support.property.invariants``; a failure
names the invariant, and hypothesis prints the shrunk scenario with every request as it was
sent.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.property.invariants import Scenario, run_scenario
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


def scenario_test(scenarios: Callable[[str], st.SearchStrategy[Scenario]]) -> Callable[..., None]:
    """A property test for each app kind: each scenario ``scenarios(kind)`` draws is run and
    checked. Collected under the name it is assigned to."""

    @KINDS
    @PROPERTY_SETTINGS
    @given(data=st.data())
    def test(kind: str, data: st.DataObject) -> None:
        run_scenario(data.draw(scenarios(kind), label="scenario"))

    parametrized: Callable[..., None] = test  # the mark leaves no type
    return parametrized


test_related_bodies_one_after_another = scenario_test(sequential_pairs)
test_confusable_values = scenario_test(confusable_twins)
test_one_body_two_content_types = scenario_test(content_type_pairs)
test_concurrent_duplicates = scenario_test(concurrent_duplicates)
test_key_field_lines = scenario_test(key_variants)
test_chunking_content_length_and_disconnects = scenario_test(transports)
test_mixtures = scenario_test(mixtures)
