"""Runs a scenario against the guarded app and holds every answer to the invariants.

1. No 5xx (or exception, or missing answer) that the bare app does not give for the same request.
2. No second execution of an endpoint for one key and one request, unless the earlier one
   ended transiently (5xx, 408, 429).
3. A replay repeats the first response for its key: status and body byte for byte, headers
   apart from the replay markers and Date/Server/Set-Cookie/hop-by-hop. (A first response
   the client left before it ended may be replayed whole, or marked as stored without body.)
4. A replay answers only a request that is the same as the app sees it (same method, route
   and key, and the same endpoint view); anything else gets 422 or its own answer.
5. The key verdict follows the README and RFC 9110 section 5.3 (``oracle.reference_key``):
   an invalid key, a missing one or several field lines get 400 and never run the endpoint.

Each invariant raises its own exception type, so hypothesis shrinks and reports them apart.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp

from tests.support.guarded import unguarded
from tests.support.property.apps import ROUTES, AppLog, Execution, MiddlewareOptions, build_app
from tests.support.property.driver import Exchange, RequestSpec, call
from tests.support.property.oracle import BODY_HEADERS, comparable_headers, reference_key

GUARDED_METHODS = frozenset({"POST", "PATCH"})
TRANSIENT_STATUSES = frozenset({408, 429})


class InvariantViolation(AssertionError):
    """An answer broke one of the suite's invariants."""


class ServerErrorViolation(InvariantViolation):
    """Invariant 1: a server error the bare app does not give."""


class DoubleExecutionViolation(InvariantViolation):
    """Invariant 2: an endpoint ran twice for one key and one request."""


class ReplayMismatchViolation(InvariantViolation):
    """Invariant 3: a replay differs from the first response for its key."""


class WrongReplayViolation(InvariantViolation):
    """Invariant 4: a replay answered a request that differs as the app sees it."""


class KeyVerdictViolation(InvariantViolation):
    """Invariant 5: the middleware's key verdict differs from the reference."""


_TAGGED: dict[tuple[type[InvariantViolation], str], type[InvariantViolation]] = {}


def violation(kind: type[InvariantViolation], tag: str, message: str) -> InvariantViolation:
    """An exception of a subclass of ``kind`` named after ``tag`` (a route, a cause).

    Hypothesis tells failures apart by exception type and origin, so one invariant broken on
    two routes is reported (and shrunk) as two failures, not one hiding the other.
    """
    tagged = _TAGGED.get((kind, tag))
    if tagged is None:
        tagged = _TAGGED[kind, tag] = type(f"{kind.__name__}[{tag}]", (kind,), {})
    return tagged(message)


@dataclass(frozen=True, slots=True)
class Scenario:
    """Waves of requests: the requests of one wave run concurrently, waves one after another."""

    kind: str
    waves: tuple[tuple[RequestSpec, ...], ...]
    options: MiddlewareOptions = field(default_factory=MiddlewareOptions)

    def __repr__(self) -> str:
        lines = [f"Scenario(kind={self.kind!r}, options={self.options!r}, waves=("]
        for wave in self.waves:
            lines.append("    (")
            lines.extend(f"        {spec!r}," for spec in wave)
            lines.append("    ),")
        lines.append("))")
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis prints the falsifying scenario with this


def _is_key_rejection(exchange: Exchange) -> bool:
    if exchange.status != 400:
        return False
    try:
        payload = json.loads(exchange.body)
    except ValueError:
        return False
    return isinstance(payload, dict) and "Idempotency-Key" in str(payload.get("error", ""))


def _same_body(original: Exchange, replay: Exchange) -> bool:
    """Whether the replay's body is the first response's. When the first client left before
    its body ended, it saw only a prefix: the replay may complete it, or say (with the README's
    ``X-Idempotent-Body-Omitted``) that the body was never captured."""
    if original.complete:
        return replay.body == original.body
    if replay.header(b"x-idempotent-body-omitted") == b"true":
        return replay.body == b""
    return replay.body.startswith(original.body)


def _same_headers(original: Exchange, replay: Exchange) -> bool:
    """Whether the replay repeats the first response's headers (``oracle.UNCOMPARED_HEADERS``
    aside). A body the first client never saw whole may come back omitted, and then without
    the headers that describe a body."""
    first, again = comparable_headers(original.headers), comparable_headers(replay.headers)
    if not original.complete and replay.header(b"x-idempotent-body-omitted") == b"true":
        first = [(name, value) for name, value in first if name not in BODY_HEADERS]
    return first == again


def _storable(status: int | None) -> bool:
    return status is not None and status < 500 and status not in TRANSIENT_STATUSES


class ScenarioRun:
    """One scenario on a fresh app and store. With ``keep_going`` a violation ends only its
    wave, and :attr:`violations` collects them all (for table tests, where each wave is a case
    of its own, with a key of its own)."""

    def __init__(self, scenario: Scenario, *, keep_going: bool = False) -> None:
        self.scenario = scenario
        self.keep_going = keep_going
        self.violations: list[InvariantViolation] = []
        self.kind = scenario.kind
        self.log = AppLog()
        self.app = build_app(self.kind, self.log, scenario.options)
        self._bare_log = AppLog()
        self._bare: ASGIApp | None = None
        self.exchanges: list[Exchange] = []
        self.by_serial: dict[int, Exchange] = {}
        self._templates = {
            path: (route.template, route.methods)
            for route in ROUTES[self.kind]
            for path in route.paths
        }

    async def run(self) -> None:
        for wave in self.scenario.waves:
            try:
                await self.wave(wave)
            except InvariantViolation as exc:
                if not self.keep_going:
                    raise
                self.violations.append(exc)

    async def wave(self, specs: Sequence[RequestSpec]) -> None:
        exchanges = await asyncio.gather(*(call(self.app, spec) for spec in specs))
        for exchange in exchanges:
            serial = exchange.serial
            if serial is not None and not exchange.replayed:
                self.by_serial.setdefault(serial, exchange)
        self.exchanges.extend(exchanges)
        for exchange in exchanges:
            await self._check_server_error(exchange)
            self._check_key_verdict(exchange)
            if exchange.replayed:
                await self._check_replay(exchange)
        self._check_executions()

    # -- helpers ------------------------------------------------------------------------------

    def _guarded(self, spec: RequestSpec) -> bool:
        route = self._templates.get(spec.path)
        return route is not None and spec.method in GUARDED_METHODS and spec.method in route[1]

    def _template(self, spec: RequestSpec) -> str:
        return self._templates.get(spec.path, (spec.path,))[0]

    def _identity(self, spec: RequestSpec) -> tuple[object, ...]:
        verdict = reference_key(spec.key_values)
        key: object = verdict.key if verdict.key is not None else ("raw", spec.key_values)
        return (spec.method, self._template(spec), key)

    async def _bare_call(self, spec: RequestSpec) -> tuple[Exchange, Execution | None]:
        if self._bare is None:
            self._bare = unguarded(build_app(self.kind, self._bare_log, None))
        before = len(self._bare_log.executions)
        exchange = await call(self._bare, spec)
        ran = self._bare_log.executions[before:]
        return exchange, ran[0] if ran else None

    async def _view(self, spec: RequestSpec) -> str:
        """The request as the app sees it: its endpoint's view, or what the app answered
        instead of running the endpoint."""
        exchange, execution = await self._bare_call(
            RequestSpec(
                method=spec.method,
                path=spec.path,
                key_values=spec.key_values,
                content_type=spec.content_type,
                body=spec.body,
                extra_headers=spec.extra_headers,
            )
        )
        if execution is not None:
            return execution.view
        return f"not run: the bare app answered {exchange.status}"

    def _context(self) -> str:
        return "\n".join(f"#{n}\n{ex.describe()}" for n, ex in enumerate(self.exchanges, 1))

    # -- the invariants -----------------------------------------------------------------------

    async def _check_server_error(self, exchange: Exchange) -> None:
        if not exchange.failed:
            return
        bare, _ = await self._bare_call(exchange.spec)
        if bare.failed:
            return
        # Raised from the app's own exception, so that two causes are two failures.
        raise violation(
            ServerErrorViolation,
            "raised" if exchange.exception else self._template(exchange.spec),
            "invariant 1: a server error the bare app does not give\n"
            f"guarded app:\n{exchange.describe()}\nbare app:\n{bare.describe()}\n"
            f"all exchanges so far:\n{self._context()}",
        ) from exchange.exception

    def _check_key_verdict(self, exchange: Exchange) -> None:
        spec = exchange.spec
        if not self._guarded(spec) or exchange.status is None or exchange.failed:
            return
        verdict = reference_key(spec.key_values)
        rejected = _is_key_rejection(exchange)
        if verdict.key is None and not rejected:
            raise violation(
                KeyVerdictViolation,
                str(verdict.problem),
                f"invariant 5: the key field lines {list(spec.key_values)!r} carry no usable key "
                f"({verdict.problem}), but the request was not answered 400\n{exchange.describe()}",
            )
        if verdict.key is not None and rejected:
            raise violation(
                KeyVerdictViolation,
                "valid key rejected",
                f"invariant 5: the key {verdict.key!r} is valid, but the request got 400\n"
                f"{exchange.describe()}",
            )

    async def _check_replay(self, exchange: Exchange) -> None:
        serial = exchange.serial
        original = self.by_serial.get(serial) if serial is not None else None
        tag = self._template(exchange.spec)
        if original is None:
            raise violation(
                ReplayMismatchViolation,
                tag,
                "invariant 3: a replay of a response no earlier request received\n"
                f"{exchange.describe()}\nall exchanges so far:\n{self._context()}",
            )
        if (
            original.status != exchange.status
            or not _same_body(original, exchange)
            or not _same_headers(original, exchange)
        ):
            raise violation(
                ReplayMismatchViolation,
                tag,
                "invariant 3: the replay differs from the first response for its key\n"
                f"first response:\n{original.describe()}\nreplay:\n{exchange.describe()}",
            )
        if self._identity(original.spec) != self._identity(exchange.spec):
            raise violation(
                WrongReplayViolation,
                tag,
                "invariant 4: a replay of another key's (or route's) response\n"
                f"first response:\n{original.describe()}\nreplay:\n{exchange.describe()}",
            )
        if original.spec.same_request(exchange.spec):
            return
        first_view = self.log.executions[serial - 1].view if serial is not None else ""
        view = await self._view(exchange.spec)
        if view != first_view:
            raise violation(
                WrongReplayViolation,
                tag,
                "invariant 4: a request that differs as the app sees it got another request's "
                "stored response\n"
                f"first request (the endpoint saw {first_view[:300]!r}):\n{original.describe()}\n"
                f"replayed request (the endpoint would see {view[:300]!r}):\n{exchange.describe()}",
            )

    def _check_executions(self) -> None:
        groups: dict[tuple[object, ...], list[Execution]] = defaultdict(list)
        for execution in self.log.executions:
            if execution.method not in GUARDED_METHODS:
                continue
            verdict = reference_key(execution.key_values)
            key = verdict.key if verdict.key is not None else ("raw", execution.key_values)
            groups[(execution.method, execution.template, key, execution.body)].append(execution)
        for runs in groups.values():
            for index, later in enumerate(runs):
                earlier = next((run for run in runs[:index] if _storable(run.status)), None)
                if earlier is None:
                    continue
                raise violation(
                    DoubleExecutionViolation,
                    later.template,
                    f"invariant 2: the endpoint {later.method} {later.template} ran again "
                    f"(execution #{later.serial}) for key field lines {list(later.key_values)!r} "
                    f"and the same body after execution #{earlier.serial} answered "
                    f"{earlier.status}\nall exchanges:\n{self._context()}",
                )


def run_scenario(scenario: Scenario) -> None:
    """Run ``scenario`` on a fresh event loop, app and store; raise on the first violation."""
    asyncio.run(ScenarioRun(scenario).run())
