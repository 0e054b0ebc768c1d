"""The client half of the protocol: httpx transports that send an ``Idempotency-Key`` and retry
with the same key until the server's answer is final.

Wrap any transport::

    client = httpx.Client(transport=IdempotentTransport())
    client = httpx.AsyncClient(transport=AsyncIdempotentTransport(httpx.AsyncHTTPTransport()))

Connection options (``proxy``, ``verify``, ``cert``, ``http2``, ``limits``, ``trust_env``) go on
the wrapped transport, ``IdempotentTransport(httpx.HTTPTransport(proxy=..., verify=...))``: httpx
applies a client's own only to a transport it builds, and a client's ``proxy=`` mounts one that
takes every request past this one (no key, no retries).

POST and PATCH requests without a key get a fresh UUID4 key; a key the caller set is kept. A key
the transport generated is for its request's method and URL alone: a redirect's request does not
carry it (a POST or PATCH gets a new one), so it never reaches another path or origin. Every
other method is sent once, untouched. For POST and PATCH the transport decides as follows:

===========================================  ==========  =====================================
What came back                               Retried?    Key
===========================================  ==========  =====================================
timeout, connection error, dropped reply     yes         same key (the handler may have run)
409 with ``Retry-After`` (in progress)       yes         same key, not before ``Retry-After``
429, 500, 502, 503, 504                      yes         same key, not before ``Retry-After``
``Retry-After`` above ``max_retry_after``    no          final: returned at once
a wait that would end after ``deadline``     no          final: returned (or raised) at once
``X-Idempotent-Replay: true`` (any status)   no          final: the stored answer
``Idempotent-Replayed: true`` (Stripe's)     no          final: the stored answer
``X-Idempotent-Body-Omitted: true`` replay   no          final: the stored answer kept without
                                                         its body (empty); the request ran, so
                                                         never send it again with a new key
409 without a readable ``Retry-After``       no          final
400, 401, 403, 422                           never       fix the request, then use a new key
                                                         (a generated key is replaced when
                                                         an auth flow sends the request again,
                                                         if this answered its first attempt)
202 ``{"status": "requires_recovery"}``      no          final, and not a success: retry later
                                                         with the same key (its request's
                                                         ``Idempotency-Key`` header)
any other status                             no          final
===========================================  ==========  =====================================

The wait before retry ``n`` (``n = 0`` for the first retry) is::

    base    = backoff_base * 2**n
    backoff = min(base + jitter, backoff_cap)    jitter = rng() * base, uniform in [0, base)
    wait    = backoff                            without a readable Retry-After
    wait    = max(retry_after, backoff)          with one

so the first wait lies in ``[backoff_base, 2 * backoff_base)``. A ``Retry-After``
(delta-seconds or HTTP-date) on a retried response is a floor on the wait: the server may slow
the client down, never speed it up past its own backoff (whose jitter keeps clients that were
told the same thing from coming back together), and ``backoff_cap`` caps the computed backoff
only, never ``Retry-After``. A ``Retry-After`` longer than ``max_retry_after`` makes the
response final: it is returned at once rather than retried before the server said. So is one
that would cross the deadline. ``max_attempts`` counts every attempt, the first included.
``deadline`` bounds all attempts together: a retry whose wait would end after it is not made,
and the last response is returned (or the last error re-raised). It is measured on the monotonic
clock, which a stepped wall clock does not move. Per-attempt time limits stay with httpx's own
``timeout``.

A retry must send the same bytes, so the request body is read into memory before the first
attempt; a streaming body (generator, iterator, file) is refused up front with
:class:`NonReplayableRequestError`. Each POST/PATCH response is read into memory inside the
transport too, so a connection that drops in the middle of the response body is retried as well
(and the connection of a discarded response goes back to the pool). The caller gets it only once
it has ended: ``client.stream("POST", ...)`` sees no byte before the last, and a response that
never ends (server-sent events) never returns.

Besides the standard library this module imports only httpx (and anyio, which httpx depends on)
and the package's Starlette-free ``_types`` and ``errors``; never Starlette.
"""

from __future__ import annotations

from starlette_idempotency.client._retry_policy import (
    DEFAULT_RETRY_STATUSES,
    RetryPolicy,
    Rng,
    parse_retry_after,
)
from starlette_idempotency.client._transports import (
    IDEMPOTENT_METHODS,
    AsyncIdempotentTransport,
    AsyncSleep,
    IdempotentTransport,
    NonReplayableRequestError,
    Sleep,
)

__all__ = [
    "DEFAULT_RETRY_STATUSES",
    "IDEMPOTENT_METHODS",
    "AsyncIdempotentTransport",
    "AsyncSleep",
    "IdempotentTransport",
    "NonReplayableRequestError",
    "RetryPolicy",
    "Rng",
    "Sleep",
    "parse_retry_after",
]
