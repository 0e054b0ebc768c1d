from __future__ import annotations

import pytest

from tests.support.guarded import BUILDERS, GuardedApp, make_guarded_app


@pytest.fixture(params=sorted(BUILDERS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def harness(kind: str) -> GuardedApp:
    return await make_guarded_app(kind)
