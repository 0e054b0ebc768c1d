"""The payments demo answers only as its OpenAPI says, the idempotency middleware included.

schemathesis generates requests from the demo's own ``/openapi.json`` (which the middleware
completes) and checks each response: no server error, a documented status code and content
type, and a body and headers that match the documented schema. The demo runs in-process
(schemathesis's ASGI client runs its lifespan) on this run's PostgreSQL database, with
``PostgresStore`` as the idempotency store and the demo delay capped at a few milliseconds.

Two phases: every call with the ``Idempotency-Key`` schemathesis draws from the header's own
schema (which says exactly what the middleware accepts, so no drawn key may be refused with a
400); then keys reused, so that calls meet
the middleware's replays (the same request again) and its 422 (a key reused with another
request). Examples are derandomized and bounded (:data:`EXAMPLES` per operation and phase), so
a run is repeatable and short. The last tests pin what schemathesis found in the demo.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import pytest
import schemathesis
from examples.payments.app import Settings, create_app
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import APIOperation, Case, Response
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

pytestmark = pytest.mark.postgres

Operation: TypeAlias = APIOperation[Any, Any, Any, Any]
Example: TypeAlias = Case[Any]

EXAMPLES = 25
MAX_DELAY_MS = 20
KEY = "Idempotency-Key"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
GUARDED = {"POST", "PATCH"}

bounded = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def demo(postgres_dsn: str) -> Iterator[OpenApiSchema]:
    """The demo's schema, loaded from the running demo (lifespan started by schemathesis)."""
    app = create_app(
        Settings(
            database_url=postgres_dsn,
            store="postgres",
            pod_id="pod-schemathesis",
            max_demo_delay_ms=MAX_DELAY_MS,
        )
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    try:
        yield schema
    finally:
        # schemathesis keeps a started lifespan until the process exits; the pools must close
        # before the run drops its database
        shutdown_lifespans()


def call(case: Example, key: str | None) -> Response:
    """Send ``case`` with ``key`` (``None``: the key schemathesis drew, if any) and check the
    response; returns the response."""
    response = case.call(headers=None if key is None else {KEY: key}, timeout=10)
    case.validate_response(response, checks=CHECKS)
    return response


def for_each_operation(schema: OpenApiSchema, test: Callable[[Operation, Example], None]) -> None:
    """Run ``test`` on bounded examples of every operation; report every failing operation."""
    failures = []
    for operation in operations(schema):
        try:
            _examples_of(operation, test)()
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}:\n{exc}")
    assert not failures, "\n\n".join(failures)


def _examples_of(
    operation: Operation, test: Callable[[Operation, Example], None]
) -> Callable[[], None]:
    @bounded
    @given(case=operation.as_strategy())
    def run(case: Example) -> None:
        test(operation, case)

    return run


def test_the_demo_answers_as_documented_with_the_keys_its_schema_allows(
    demo: OpenApiSchema,
) -> None:
    drawn: set[str] = set()

    def test(operation: Operation, case: Example) -> None:
        headers: dict[str, Any] = dict(case.headers or {})
        key = headers.get(KEY)
        if key is not None:
            drawn.add(key)
        response = call(case, None)
        assert not refused_key(operation, response), (key, response.text)

    for_each_operation(demo, test)
    # the draws reached the corners of the grammar: quoted strings, and the longest keys
    assert any(key.startswith('"') for key in drawn)
    assert any(key.startswith('"') and "\\" in key for key in drawn)


def test_the_demo_answers_as_documented_when_keys_are_reused(demo: OpenApiSchema) -> None:
    # Keys are scoped by method and route: each operation meets the records of its own earlier
    # examples, a replay for the same request, a 422 for another one.
    keys = [str(uuid.uuid4()) for _ in range(3)]
    turns = itertools.count()
    replays = []

    def test(operation: Operation, case: Example) -> None:
        key = keys[next(turns) % len(keys)]
        first = call(case, key)
        again = call(case, key)
        assert not refused_key(operation, first)
        if operation.method.upper() in GUARDED and 200 <= first.status_code < 300:
            assert again.headers["x-idempotent-replay"] == ["true"]
            assert (again.status_code, again.content) == (first.status_code, first.content)
            replays.append(operation.label)

    for_each_operation(demo, test)
    assert {"POST /payments", "POST /orders/submit"} <= set(replays)


def refused_key(operation: Operation, response: Response) -> bool:
    """Whether the middleware refused the key sent (a 400 on a guarded operation)."""
    return operation.method.upper() in GUARDED and response.status_code == 400


def payment(**fields: str) -> dict[str, Any]:
    return {
        "accountId": "acc-1",
        "amount": "10.00",
        "currency": "EUR",
        "merchantReference": f"ref-{uuid.uuid4().hex}",
        **fields,
    }


def test_the_middlewares_own_answers_are_documented(demo: OpenApiSchema) -> None:
    guarded = {operation.label for operation in operations(demo) if key_parameter(operation)}
    assert guarded == {
        "POST /payments",
        "POST /charges",
        "POST /members",
        "PATCH /members/{member_id}",
        "POST /orders/submit",
    }
    pay = demo["/payments"]["POST"]
    assert call(pay.Case(body=payment()), "two,keys").status_code == 400
    no_key = pay.Case(body=payment())
    missing = no_key.call(timeout=10)  # no key at all
    no_key.validate_response(missing, checks=CHECKS)
    assert missing.status_code == 400
    key = str(uuid.uuid4())
    assert call(pay.Case(body=payment()), key).status_code == 200
    assert call(pay.Case(body=payment()), key).status_code == 422  # another request, same key
    too_large = payment(merchantReference="r" * (1024 * 1024))
    assert call(pay.Case(body=too_large), str(uuid.uuid4())).status_code == 413


def operations(schema: OpenApiSchema) -> list[Operation]:
    found = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()
        found.append(result.ok())
    return found


def key_parameter(operation: Operation) -> bool:
    parameters = operation.definition.raw.get("parameters", [])
    return any(p["in"] == "header" and p["name"] == KEY for p in parameters)


def test_text_with_u0000_is_a_documented_422_not_a_database_error(demo: OpenApiSchema) -> None:
    body = payment(accountId="acc\x00")
    refused = call(demo["/payments"]["POST"].Case(body=body), f"nul-{uuid.uuid4()}")
    assert refused.status_code == 422
    query = {"merchantReference": "ref\x00"}
    assert call(demo["/provider/charges"]["GET"].Case(query=query), "unused").status_code == 422
    items = [{"sku": "\x00", "quantity": 1}]
    order: dict[str, Any] = {"orderReference": "o-1", "accountId": "acc-1", "items": items}
    submitted = call(demo["/orders/submit"]["POST"].Case(body=order), f"nul-{uuid.uuid4()}")
    assert submitted.status_code == 422


def test_the_demos_own_404_and_409_are_documented(demo: OpenApiSchema) -> None:
    missing = demo["/members/{member_id}"]["PATCH"].Case(
        path_parameters={"member_id": str(uuid.uuid4())}, body={"name": "Ann"}
    )
    assert call(missing, f"member-{uuid.uuid4()}").status_code == 404
    member: dict[str, Any] = {"email": f"{uuid.uuid4().hex}@example.com", "name": "Ann"}
    create = demo["/members"]["POST"].Case(body=member)
    assert call(create, f"member-{uuid.uuid4()}").status_code == 200
    duplicate = call(create, f"member-{uuid.uuid4()}")
    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "duplicate_email"


def test_the_demo_delay_is_capped(demo: OpenApiSchema) -> None:
    operation = demo["/payments"]["POST"]
    (delay,) = [p for p in operation.definition.raw["parameters"] if p["name"] == "x-demo-delay-ms"]
    assert delay["schema"]["maximum"] == MAX_DELAY_MS
    too_long = operation.Case(body=payment(), headers={"X-Demo-Delay-Ms": str(MAX_DELAY_MS + 1)})
    assert call(too_long, f"delay-{uuid.uuid4()}").status_code == 422
