"""What ``exclude_fields`` costs: the raw fingerprint of a 1 MiB JSON body with and without it.

``python -m bench.fingerprint`` builds a list of order-like objects (about 2,500 orders, each
with a customer, an address and three lines) and times the raw fingerprint of it, canonical
form and SHA-256, as the middleware computes it for an ``application/json`` request:

- ``plain``: nothing excluded;
- ``order field``: ``clientTimestamp``, one in every order;
- ``line field``: ``addedAt``, one in every order line, the deepest level;
- ``absent field``: a name that occurs nowhere;
- ``object field``: ``customer``, whose value is an object.

Cases run interleaved, one call each per trial; it prints each case's median CPU time (this
thread's) and its ratio to ``plain``, as a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

import orjson

from starlette_idempotency._fingerprint import raw_body_form, request_fingerprint

CASES: dict[str, frozenset[str]] = {
    "plain": frozenset(),
    "order field": frozenset({"clienttimestamp"}),
    "line field": frozenset({"addedat"}),
    "absent field": frozenset({"signature"}),
    "object field": frozenset({"customer"}),
}


def orders_body(size: int = 1 << 20, seed: int = 7) -> bytes:
    """About ``size`` bytes of JSON: a list of orders, the same for every run."""
    rnd = random.Random(seed)
    orders: list[dict[str, Any]] = []
    total = 2
    while total < size:
        number = len(orders)
        order = {
            "orderId": f"ord_{number:08d}",
            "clientTimestamp": 1_700_000_000_000 + number,
            "customer": {
                "id": rnd.randrange(10**6),
                "name": "Ada Lovelace",
                "email": f"customer{number}@example.com",
                "address": {"street": "1 Main St", "city": "Zürich", "zip": "8000"},
            },
            "lines": [
                {
                    "sku": f"SKU-{rnd.randrange(1000):04d}",
                    "quantity": rnd.randrange(1, 5),
                    "price": round(rnd.uniform(1, 100), 2),
                    "addedAt": 1_700_000_000_000 + rnd.randrange(10**6),
                }
                for _ in range(3)
            ],
            "currency": "EUR",
            "total": round(rnd.uniform(10, 500), 2),
            "paid": rnd.random() < 0.5,
            "notes": None,
        }
        orders.append(order)
        total += len(orjson.dumps(order)) + 1
    return orjson.dumps(orders)


def fingerprint(body: bytes, excluded: frozenset[str]) -> str:
    kind, canonical = raw_body_form(body, content_type="application/json", excluded=excluded)
    return request_fingerprint(
        endpoint="bench:orders",
        method="POST",
        path="/orders",
        query_string=b"",
        headers=(),
        body_kind=kind,
        body=canonical,
    )


def measure(body: bytes, trials: int) -> dict[str, list[float]]:
    """CPU milliseconds per fingerprint, per case; the cases' order rotates between trials."""
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    names = list(CASES)
    for name in names:
        fingerprint(body, CASES[name])  # warm-up
    for trial in range(trials):
        for name in names[trial % len(names) :] + names[: trial % len(names)]:
            gc.collect()
            started = time.thread_time()
            fingerprint(body, CASES[name])
            samples[name].append((time.thread_time() - started) * 1000)
    return samples


def report(samples: dict[str, list[float]], size: int) -> str:
    plain = statistics.median(samples["plain"])
    lines = [
        f"Raw fingerprint of a {size / 2**20:.2f} MiB JSON body, CPU ms, medians of "
        f"{len(samples['plain'])} interleaved trials.",
        "",
        "| case | excluded | ms | × plain |",
        "|---|---|---|---|",
    ]
    for name, values in samples.items():
        median = statistics.median(values)
        excluded = ", ".join(sorted(CASES[name])) or "-"
        lines.append(f"| {name} | {excluded} | {median:.2f} | {median / plain:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fingerprint", description=__doc__)
    parser.add_argument("--trials", type=int, default=31, help="calls per case (default 31)")
    parser.add_argument("--size", type=int, default=1 << 20, help="body bytes (default 1 MiB)")
    args = parser.parse_args(argv)
    body = orders_body(args.size)
    print(report(measure(body, args.trials), len(body)))


if __name__ == "__main__":
    main()
