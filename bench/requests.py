"""What the harness sends the benchmarked service (:mod:`bench.app`): its paths and body.

Shared by the app, which serves these paths, and by everything that calls it (in-process
through :mod:`bench.asgi`, or over HTTP through :mod:`bench.servers` and wrk).
"""

from __future__ import annotations

PAYMENT_PATH = "/payments"
EXECUTIONS_PATH = "/__executions"
# A user's payment request: a four-field camelCase pydantic model with a float amount.
BODY = (
    b'{"accountId":"acct_1MqDcVKZ4aF9xQ2b","amount":12.5,"currency":"EUR",'
    b'"merchantReference":"order-2026-000042"}'
)
