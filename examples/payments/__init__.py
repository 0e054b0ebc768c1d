"""The payments demo: a FastAPI app on two uvicorn pods behind nginx, with a PostgreSQL ledger
and Redis (or PostgreSQL alone) as the idempotency store.

``python -m examples.payments.cluster up`` starts it; ``python -m examples.payments.stress``
drives load through it. See ``examples/payments/README.md``.
"""

from __future__ import annotations
