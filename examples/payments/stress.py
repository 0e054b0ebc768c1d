"""Stress test of the payments demo through nginx: retries never execute twice.

    python -m examples.payments.stress --url http://127.0.0.1:8080 --rps 50 --duration 30

Without ``--url`` it starts a throwaway cluster of its own (see ``cluster.py``) and stops it
afterwards. Open loop: new keys start at the target rate whatever the latency. Each key is
sent several times at once (so both pods see it); a 409 is retried with the same key after
its Retry-After (capped). Keys differ in their bodies; order keys differ between copies only
in the excluded fields ``clientTimestamp``/``requestNonce``; a few keys are deliberately
reused with another amount and must get 422. Afterwards the ledger is read back through the
read endpoints. Violations: a key with more or fewer than one ledger row, two different
bodies answered 200 for one key, any 5xx, a misuse not answered 422, a key never settled.
Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

KeyKind = Literal["payment", "order", "misuse"]

CURRENCIES = ("EUR", "USD", "GBP", "TWD")
SKUS = ("sku-apple", "sku-pear", "sku-plum", "sku-fig")


@dataclass
class StressReport:
    target_rps: float
    duration: float
    requests: int = 0
    requests_in_window: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    keys: Counter[str] = field(default_factory=Counter)
    retries_after_409: int = 0
    misuse_sent: int = 0
    misuse_422: int = 0
    pods_seen: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def rps_achieved(self) -> float:
        return self.requests_in_window / self.duration if self.duration else 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def percentile(self, share: float) -> float:
        if not self.latencies_ms:
            return 0.0
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]

    def format(self) -> str:
        statuses = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses.items()))
        keys = ", ".join(f"{kind}: {n}" for kind, n in sorted(self.keys.items()))
        pods = ", ".join(f"{pod}: {n}" for pod, n in sorted(self.pods_seen.items()))
        lines = [
            f"requests        {self.requests} in {self.duration:.1f} s "
            f"({self.rps_achieved:.1f} req/s achieved with the 409 retries; "
            f"new sends at {self.target_rps:g}/s)",
            f"keys            {sum(self.keys.values())} ({keys})",
            f"statuses        {statuses}",
            f"409 retried     {self.retries_after_409}",
            f"misuse          {self.misuse_422}/{self.misuse_sent} answered 422",
            f"served by       {pods}",
            f"latency         p50 {self.percentile(0.5):.1f} ms, "
            f"p99 {self.percentile(0.99):.1f} ms",
            f"duplicates      {self.duplicates}",
            f"violations      {len(self.violations)}",
        ]
        lines += [f"  - {violation}" for violation in self.violations[:20]]
        if len(self.violations) > 20:
            lines.append(f"  ... and {len(self.violations) - 20} more")
        lines.append("RESULT          " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


@dataclass
class _Outcome:
    status: int
    body: bytes


class _Runner:
    def __init__(
        self,
        client: httpx.AsyncClient,
        report: StressReport,
        *,
        run_id: str,
        max_retry_wait: float,
        settle_timeout: float,
        window_end: float,
    ) -> None:
        self.client = client
        self.report = report
        self.run_id = run_id
        self.max_retry_wait = max_retry_wait
        self.settle_timeout = settle_timeout
        self.window_end = window_end
        # reference -> (kind, set of 200 bodies)
        self.answers: dict[str, tuple[KeyKind, set[bytes]]] = {}

    async def request(self, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
        started = time.monotonic()
        report = self.report
        report.requests += 1
        if started < self.window_end:
            report.requests_in_window += 1
        try:
            response = await self.client.post(path, json=body, headers={"Idempotency-Key": key})
        except httpx.HTTPError as exc:
            report.statuses[0] += 1
            report.violations.append(f"{path} key {key}: transport error {exc!r}")
            raise
        report.latencies_ms.append((time.monotonic() - started) * 1000)
        report.statuses[response.status_code] += 1
        report.pods_seen[response.headers.get("x-pod-id", "?")] += 1
        if response.status_code >= 500:
            report.violations.append(
                f"{path} key {key}: {response.status_code} {response.text[:200]}"
            )
        return response

    async def settle(self, path: str, key: str, body: dict[str, Any]) -> _Outcome:
        """Send until the answer is not 409 (waiting Retry-After, capped, between tries)."""
        deadline = time.monotonic() + self.settle_timeout
        while True:
            response = await self.request(path, key, body)
            if response.status_code != 409 or time.monotonic() > deadline:
                return _Outcome(response.status_code, response.content)
            self.report.retries_after_409 += 1
            try:
                wait = float(response.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            await asyncio.sleep(min(max(wait, 0.05), self.max_retry_wait))

    def record(self, kind: KeyKind, reference: str, key: str, outcomes: Sequence[_Outcome]) -> None:
        bodies = {outcome.body for outcome in outcomes if outcome.status == 200}
        self.answers[reference] = (kind, bodies)
        for outcome in outcomes:
            if outcome.status != 200:
                self.report.violations.append(
                    f"{kind} key {key}: settled with {outcome.status} {outcome.body[:200]!r}"
                )
        if len(bodies) > 1:
            self.report.violations.append(f"{kind} key {key}: {len(bodies)} different 200 bodies")

    async def payment_key(self, index: int, copies: int, rng: random.Random) -> None:
        reference = f"{self.run_id}-p{index}"
        key = f"{self.run_id}-pay-{index}-{uuid.uuid4().hex[:8]}"
        body = {
            "accountId": f"acc-{rng.randrange(1000)}",
            "amount": f"{rng.randrange(100, 1_000_000) / 100:.2f}",
            "currency": rng.choice(CURRENCIES),
            "merchantReference": reference,
        }
        outcomes = await asyncio.gather(
            *(self.settle("/payments", key, body) for _ in range(copies))
        )
        self.record("payment", reference, key, outcomes)

    async def order_key(self, index: int, copies: int, rng: random.Random) -> None:
        reference = f"{self.run_id}-o{index}"
        key = f"{self.run_id}-order-{index}-{uuid.uuid4().hex[:8]}"
        items = [
            {"sku": sku, "quantity": rng.randrange(1, 5)}
            for sku in rng.sample(SKUS, rng.randrange(1, 3))
        ]

        def body(copy: int) -> dict[str, Any]:
            # Only the excluded fields differ between the copies of one key.
            return {
                "orderReference": reference,
                "accountId": f"acc-{index % 97}",
                "items": items,
                "clientTimestamp": f"2026-01-01T00:00:{copy:02d}.{rng.randrange(1000):03d}Z",
                "requestNonce": uuid.uuid4().hex,
            }

        outcomes = await asyncio.gather(
            *(self.settle("/orders/submit", key, body(copy)) for copy in range(copies))
        )
        self.record("order", reference, key, outcomes)

    async def misuse_key(self, index: int, rng: random.Random) -> None:
        reference = f"{self.run_id}-m{index}"
        key = f"{self.run_id}-misuse-{index}-{uuid.uuid4().hex[:8]}"
        amount = rng.randrange(100, 100_000) / 100
        body = {
            "accountId": "acc-misuse",
            "amount": f"{amount:.2f}",
            "currency": "EUR",
            "merchantReference": reference,
        }
        first = await self.settle("/payments", key, body)
        self.record("misuse", reference, key, [first])
        # The same key for another amount: must be refused, and must not pay.
        self.report.misuse_sent += 1
        reused = await self.request("/payments", key, {**body, "amount": f"{amount + 1:.2f}"})
        if reused.status_code == 422:
            self.report.misuse_422 += 1
        else:
            self.report.violations.append(
                f"misuse key {key}: reused with another amount got {reused.status_code}"
            )

    async def verify(self) -> None:
        """Every key has exactly one ledger row, and it is the one the 200s described."""
        rows: dict[str, list[dict[str, Any]]] = {}
        for path, param, field_name in (
            ("/payments", "merchantReferencePrefix", "merchantReference"),
            ("/orders", "orderReferencePrefix", "orderReference"),
        ):
            response = await self.client.get(path, params={param: self.run_id})
            response.raise_for_status()
            for row in response.json():
                rows.setdefault(row[field_name], []).append(row)
        for reference, (kind, bodies) in sorted(self.answers.items()):
            found = rows.pop(reference, [])
            if len(found) > 1:
                self.report.duplicates += len(found) - 1
                self.report.violations.append(
                    f"{kind} {reference}: {len(found)} ledger rows (pods "
                    f"{', '.join(str(row['pod']) for row in found)})"
                )
            elif not found and bodies:
                self.report.violations.append(f"{kind} {reference}: answered 200, no ledger row")
            elif found and bodies:
                answered_ids = {json.loads(body)["id"] for body in bodies}
                if answered_ids != {found[0]["id"]}:
                    self.report.violations.append(
                        f"{kind} {reference}: 200 body names {answered_ids}, "
                        f"ledger row {found[0]['id']}"
                    )
        for reference, found in rows.items():
            self.report.violations.append(f"{reference}: {len(found)} ledger rows for no key")


async def run_stress(
    url: str,
    *,
    rps: float = 50.0,
    duration: float = 30.0,
    copies: tuple[int, int] = (2, 4),
    order_share: float = 0.25,
    misuse_share: float = 0.05,
    max_retry_wait: float = 1.0,
    settle_timeout: float = 30.0,
    seed: int | None = None,
    run_id: str | None = None,
) -> StressReport:
    """Drive ``rps`` requests per second at ``url`` (nginx) for ``duration`` seconds, then
    check the ledger. Retries after 409 come on top of the target rate."""
    rng = random.Random(seed)
    run_id = run_id or f"stress-{uuid.uuid4().hex[:10]}"
    report = StressReport(target_rps=rps, duration=duration)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        started = time.monotonic()
        runner = _Runner(
            client,
            report,
            run_id=run_id,
            max_retry_wait=max_retry_wait,
            settle_timeout=settle_timeout,
            window_end=started + duration,
        )
        tasks: list[asyncio.Task[None]] = []
        scheduled = 0  # first attempts scheduled so far
        index = 0
        while time.monotonic() - started < duration:
            draw = rng.random()
            n = rng.randint(*copies)
            if draw < misuse_share:
                kind: KeyKind = "misuse"
                task = runner.misuse_key(index, rng)
                n = 2
            elif draw < misuse_share + order_share:
                kind = "order"
                task = runner.order_key(index, n, rng)
            else:
                kind = "payment"
                task = runner.payment_key(index, n, rng)
            report.keys[kind] += 1
            tasks.append(asyncio.create_task(task))
            scheduled += n
            index += 1
            await asyncio.sleep(max(0.0, started + scheduled / rps - time.monotonic()))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, httpx.HTTPError):
                report.violations.append(f"load task failed: {result!r}")
        await runner.verify()
    if report.rps_achieved < 0.9 * rps:
        report.violations.append(
            f"only {report.rps_achieved:.1f} req/s achieved, below 90% of the target {rps:g}"
        )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.payments.stress", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--url", help="nginx URL; without it a throwaway cluster is started")
    parser.add_argument("--rps", type=float, default=50.0)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds")
    parser.add_argument("--store", choices=["redis", "postgres"], default="redis")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    def run(url: str) -> StressReport:
        print(f"stress: {args.rps:g} req/s for {args.duration:g} s against {url}", flush=True)
        return asyncio.run(run_stress(url, rps=args.rps, duration=args.duration, seed=args.seed))

    if args.url:
        report = run(args.url)
    else:
        from examples.payments.cluster import Cluster

        print(f"starting a throwaway cluster (store: {args.store}) ...", flush=True)
        with Cluster(store=args.store) as cluster:
            report = run(cluster.url)
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
