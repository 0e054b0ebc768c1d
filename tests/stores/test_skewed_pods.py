"""Two pods, in processes of their own, whose wall clocks disagree by seconds or minutes, either
way, or jump while a request runs: a handler that saved a recovery point and still runs is
never taken over nor reported dead (``202 requires_recovery``) by the other pod.

Leases are set and judged on the store's clock (Redis ``TIME``, PostgreSQL ``now()``), never on
a pod's; each pod's ``time.time`` is off by its own offset (see :mod:`.pod_app`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import httpx
import pytest

from tests.stores.pod_app import LOCK_TTL_SECONDS
from tests.support.conditions import eventually
from tests.support.pods import Pods

ROUTES = ("pay", "pay-hold")


@dataclass(frozen=True)
class Skew:
    holder: float
    retrier: float
    #: Which pod's clock jumps, and by how much, once the holder saved its recovery point.
    jump: tuple[str, float] | None = None


SCENARIOS = {
    "holder behind by seconds": Skew(holder=-4, retrier=0),
    "holder ahead by seconds": Skew(holder=4, retrier=0),
    "holder behind by minutes": Skew(holder=-120, retrier=0),
    "holder ahead by minutes": Skew(holder=120, retrier=0),
    "retrier ahead by minutes": Skew(holder=0, retrier=120),
    "retrier behind by minutes": Skew(holder=0, retrier=-120),
    "holder's clock jumps back mid-request": Skew(holder=0, retrier=0, jump=("holder", -120)),
    "holder's clock jumps forward mid-request": Skew(holder=0, retrier=0, jump=("holder", 120)),
    "retrier's clock jumps forward mid-request": Skew(holder=0, retrier=0, jump=("retrier", 120)),
}


async def set_clock(pod: httpx.AsyncClient, offset: float) -> None:
    assert (await pod.post("/_clock", json={"offset": offset})).status_code == 200


async def checkpointed(pod: httpx.AsyncClient, key: str) -> bool:
    return bool((await pod.get(f"/_runs/{key}")).json()["checkpointed"])


async def lease(pod: httpx.AsyncClient, route: str, key: str) -> float | None:
    locked_until: float | None = (await pod.get(f"/_lease/{route}/{key}")).json()["locked_until"]
    return locked_until


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_a_running_handler_is_neither_taken_over_nor_called_dead(
    pods: Pods, scenario: str
) -> None:
    skew = SCENARIOS[scenario]
    await set_clock(pods.holder, skew.holder)
    await set_clock(pods.retrier, skew.retrier)
    keys = {route: f"{route}-{uuid.uuid4().hex[:12]}" for route in ROUTES}

    def post(pod: httpx.AsyncClient, route: str) -> asyncio.Task[httpx.Response]:
        headers = {"Idempotency-Key": keys[route]}
        return asyncio.create_task(pod.post(f"/{route}", json={}, headers=headers))

    firsts = {route: post(pods.holder, route) for route in ROUTES}
    for route in ROUTES:

        async def saved(route: str = route) -> bool:
            return await checkpointed(pods.holder, keys[route])

        await eventually(saved, message=f"the handler of /{route} to save its recovery point")
    if skew.jump is not None:
        pod_name, step = skew.jump
        jumping = pods.holder if pod_name == "holder" else pods.retrier
        leases = {route: await lease(pods.holder, route, keys[route]) for route in ROUTES}
        await set_clock(jumping, (skew.holder if pod_name == "holder" else skew.retrier) + step)
        for route in ROUTES:  # the holder renewed its lease at least once since the jump

            async def renewed(route: str = route) -> bool:
                return await lease(pods.holder, route, keys[route]) != leases[route]

            await eventually(
                renewed, timeout=LOCK_TTL_SECONDS * 2, message=f"/{route}'s lease to be renewed"
            )

    for route in ROUTES:
        busy = await post(pods.retrier, route)
        assert busy.status_code == 409, f"/{route}: {busy.status_code} {busy.text}"
        assert busy.json()["code"] == "idempotency_key_in_use"

    for route in ROUTES:
        await pods.holder.post(f"/_release/{keys[route]}")
        first = await firsts[route]
        assert first.status_code == 201
        assert first.json() == {"recovered_from": None}
        replay = await post(pods.retrier, route)
        assert replay.status_code == 201
        assert replay.headers["x-idempotent-replay"] == "true"
        runs = [
            (await pod.get(f"/_runs/{keys[route]}")).json()["runs"]
            for pod in pods.__dict__.values()
        ]
        assert runs == [1, 0], f"/{route}: the handler ran on both pods"
