"""``idempotency_context(request).derived_key(label)``: the same on every retry of a request and
after a takeover of its key (through two pods: ``tests/stores/test_transaction_pods.py``);
never the same for another key, scope, route, body or label; a provider-safe string that
reveals neither the client's key nor the scope."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    MemoryStore,
    idempotency_context,
    idempotent,
)
from starlette_idempotency._endpoint import IdempotencyContext, KeyOwner
from tests.support.guarded import make_client

DERIVED = re.compile(r"[A-Za-z0-9_-]{43}")


def app_recording(derived: list[str]) -> Starlette:
    async def pay(request: Request) -> Response:
        context = idempotency_context(request)
        derived.append(context.derived_key(request.query_params.get("label", "provider.charge")))
        return JSONResponse({"key": derived[-1]})

    app = Starlette(
        routes=[
            Route("/pay", idempotent()(pay), methods=["POST"]),
            Route("/refund", idempotent()(pay), methods=["POST"]),
        ]
    )
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), key_scope=scope_of)
    return app


def scope_of(request: HTTPConnection) -> str:
    return request.headers.get("x-tenant", "t1")


async def test_it_is_stable_for_one_request_and_apart_for_any_other() -> None:
    derived: list[str] = []
    async with make_client(app_recording(derived)) as client:

        async def call(
            path: str = "/pay",
            key: str = "k1",
            body: bytes = b"{}",
            tenant: str = "t1",
            label: str | None = None,
        ) -> None:
            headers = {"Idempotency-Key": key, "content-type": "application/json"}
            url = path if label is None else f"{path}?label={label}"
            await client.post(url, content=body, headers={**headers, "x-tenant": tenant})

        await call()
        await call(key="k2")
        await call(tenant="t2")
        await call(path="/refund")
        await call(body=b'{"amount": 1}', key="k3")
        await call(body=b'{"amount": 2}', key="k4")
        await call(label="ledger.post", key="k5")
    assert len(set(derived)) == len(derived)
    assert all(DERIVED.fullmatch(key) for key in derived)


class Owner(KeyOwner):
    def __init__(self, key: str, store_key: str, fingerprint: str) -> None:
        self.key, self.store_key, self._fingerprint = key, store_key, fingerprint
        self.inherited = ()

    @property
    def request_fingerprint(self) -> str:
        return self._fingerprint


@given(
    key=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=8, max_size=255),
    scope=st.text(min_size=1, max_size=40),
    label=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=200),
)
def test_it_is_provider_safe_and_reveals_nothing(key: str, scope: str, label: str) -> None:
    context = IdempotencyContext(Owner(key, f"{scope}:POST:/pay:{key}", "sha256:x"))
    derived = context.derived_key(label)
    assert DERIVED.fullmatch(derived)
    assert key not in derived
    assert context.derived_key(label) == derived
    assert context.derived_key(label + "x") != derived


@pytest.mark.parametrize("label", ["", " spaced", "ü", "x" * 201, 7])
def test_a_label_that_is_no_visible_ascii_is_refused(label: object) -> None:
    context = IdempotencyContext(Owner("k", "s:POST:/pay:k", "sha256:x"))
    with pytest.raises(ConfigurationError, match="derived_key"):
        context.derived_key(label)  # type: ignore[arg-type]
