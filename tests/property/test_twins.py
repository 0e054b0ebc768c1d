"""Every pair of confusable values (``bodies.TWINS``) on every route, in both orders.

The property tests draw these pairs too, but a derandomized run of a few dozen examples cannot
promise to meet each pair on each route; this table does, in one app per pair (a key per case).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.support.property.apps import ROUTES
from tests.support.property.bodies import TWINS, encode, place_twin, render
from tests.support.property.driver import RequestSpec
from tests.support.property.invariants import Scenario, ScenarioRun


def _cases(kind: str, first: str, second: str) -> list[tuple[RequestSpec, ...]]:
    waves: list[tuple[RequestSpec, ...]] = []
    for route in ROUTES[kind]:
        if route.model:
            documents = [
                (place_twin(a, field=f), place_twin(b, field=f))
                for f in ("amount", "fee", "note", "meta")
                for a, b in ((first, second), (second, first))
            ]
        else:
            documents = [
                (
                    place_twin(a, field=None, depth=d, shape="object"),
                    place_twin(b, field=None, depth=d, shape="object"),
                )
                for d in (0, 1)
                for a, b in ((first, second), (second, first))
            ]
        for a, b in documents:
            key = (f"case-{len(waves)}".encode(),)
            for document in (a, b):
                body = encode(render(document))
                waves.append((RequestSpec(path=route.paths[0], key_values=key, body=body),))
    return waves


def _id(pair: tuple[str, str]) -> str:
    return "~".join(text.encode("ascii", "backslashreplace").decode() for text in pair)


@pytest.mark.parametrize("kind", ["starlette", "fastapi"])
@pytest.mark.parametrize(("first", "second"), TWINS, ids=[_id(pair) for pair in TWINS])
def test_twin_values_on_every_route(kind: str, first: str, second: str) -> None:
    run = ScenarioRun(Scenario(kind, tuple(_cases(kind, first, second))), keep_going=True)
    asyncio.run(run.run())
    if run.violations:
        pytest.fail("\n\n".join(str(violation) for violation in run.violations), pytrace=False)
