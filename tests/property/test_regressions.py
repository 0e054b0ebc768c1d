"""The smallest failing scenarios the property tests have found, kept as fixed cases so that
CI checks each of them on every run, whatever the generators happen to draw.

Each id names the invariant the scenario broke when it was found (see ``invariants``).
"""

from __future__ import annotations

import pytest

from tests.support.property.driver import RequestSpec
from tests.support.property.invariants import Scenario, run_scenario


def _one_after_another(kind: str, *requests: RequestSpec) -> Scenario:
    return Scenario(kind, tuple((request,) for request in requests))


def _pair(kind: str, path: str, first: bytes, second: bytes) -> Scenario:
    return _one_after_another(
        kind, RequestSpec(path=path, body=first), RequestSpec(path=path, body=second)
    )


DEEP = b"[" * 255 + b"0" + b"]" * 255


def _deep_meta(depth: int) -> bytes:
    return b'{"amount":0,"meta":' + b'{"a":' * depth + b"0" + b"}" * (depth + 1)


FOUND = {
    "inv1-json-nested-255-deep": _one_after_another("starlette", RequestSpec(body=DEEP)),
    "inv1-raw-route-nested-255-deep": _one_after_another(
        "fastapi", RequestSpec(path="/raw", body=DEEP)
    ),
    "inv1-validated-int-past-64-bits": _one_after_another(
        "fastapi",
        RequestSpec(path="/validated", body=b'{"amount":0,"quantity":18446744073709551616}'),
    ),
    "inv1-validated-lone-surrogate": _one_after_another(
        "fastapi", RequestSpec(path="/validated", body=b'{"amount":0,"note":"\\ud800"}')
    ),
    # Three causes, by depth: the encoder's limit, the command walk's recursion, the parser's.
    "inv1-validated-nested-256-deep": _one_after_another(
        "fastapi", RequestSpec(path="/validated", body=_deep_meta(254))
    ),
    "inv1-validated-nested-600-deep": _one_after_another(
        "fastapi", RequestSpec(path="/validated", body=_deep_meta(600))
    ),
    "inv1-validated-nested-990-deep": _one_after_another(
        "fastapi", RequestSpec(path="/validated", body=_deep_meta(990))
    ),
    "inv4-json-2**64-vs-2**64+1": _pair(
        "starlette", "/json", b"18446744073709551616", b"18446744073709551617"
    ),
    "inv4-json-int-vs-float-past-64-bits": _pair(
        "starlette", "/json", b"18446744073709551616", b"1.8446744073709552e19"
    ),
    "inv4-exclude-negative-int-past-64-bits": _pair(
        "fastapi", "/exclude", b"-18446744073709551617", b"-18446744073709551616"
    ),
    "inv4-validated-nan-vs-null": _pair(
        "fastapi", "/validated", b'{"amount":0,"fee":NaN}', b'{"amount":0,"fee":null}'
    ),
    "inv4-validated-nan-vs-infinity": _pair(
        "fastapi", "/validated", b'{"amount":NaN}', b'{"amount":Infinity}'
    ),
    # FastAPI reads only a JSON media type as JSON; the validated fingerprint read any body.
    "inv4-validated-json-body-sent-as-form": _one_after_another(
        "fastapi",
        RequestSpec(path="/validated", body=b'{"amount":1}'),
        RequestSpec(
            path="/validated",
            content_type=b"application/x-www-form-urlencoded",
            body=b'{"amount":1}',
        ),
    ),
    # The app reads the first Content-Type, the middleware read the last one.
    "inv4-model-second-content-type": _one_after_another(
        "fastapi",
        RequestSpec(path="/model", body=b'{"amount":1}'),
        RequestSpec(
            path="/model",
            content_type=b"text/plain",
            body=b'{"amount": 1}',
            extra_headers=((b"content-type", b"application/json"),),
        ),
    ),
    # JSON too deep to canonicalise is hashed as bytes, as is a body without a Content-Type,
    # which FastAPI does not read as JSON.
    "inv4-model-deep-json-vs-no-content-type": _one_after_another(
        "fastapi",
        RequestSpec(path="/model", body=_deep_meta(300)),
        RequestSpec(path="/model", content_type=None, body=_deep_meta(300)),
    ),
    "inv5-comma-in-key": _one_after_another(
        "starlette", RequestSpec(key_values=(b"k1,k2",), body=b"{}")
    ),
    "inv2-stream-client-left-then-retry": _one_after_another(
        "starlette",
        RequestSpec(path="/stream", body=b"{}", disconnect="after_body"),
        RequestSpec(path="/stream", body=b"{}"),
    ),
}


@pytest.mark.parametrize("scenario", FOUND.values(), ids=FOUND.keys())
def test_found_scenario(scenario: Scenario) -> None:
    run_scenario(scenario)
