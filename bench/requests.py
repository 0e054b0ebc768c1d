"""What the harness sends the benchmarked service (:mod:`bench.app`): its paths and bodies.

Shared by the app, which serves these paths, and by everything that calls it (in-process
through :mod:`bench.asgi`, or over HTTP through :mod:`bench.servers` and wrk), so none of the
callers has to import the app to know what to send.
"""

from __future__ import annotations

from bench.configs import AppName

PAYMENT_PATH = "/payments"
EXECUTIONS_PATH = "/__executions"
GC_PATH = "/__gc"
PREFILL_PATH = "/__prefill"
REQUEST_BODY = (
    b'{"account_id":"acct_1MqDcVKZ4aF9xQ2b","amount":1250,"currency":"EUR",'
    b'"reference":"order-2026-000042"}'
)
PAYMENTS_BODY = (
    b'{"accountId":"acct_1MqDcVKZ4aF9xQ2b","amount":12.5,"currency":"EUR",'
    b'"merchantReference":"order-2026-000042"}'
)
REQUEST_BODIES: dict[AppName, bytes] = {"plain": REQUEST_BODY, "payments": PAYMENTS_BODY}
