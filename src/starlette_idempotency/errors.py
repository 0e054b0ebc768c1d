"""Exceptions raised by starlette-idempotency.

Hierarchy::

    IdempotencyError
    ├── StoreError                 a store call failed (connection, timeout, protocol)
    │   └── StoreTimeoutError      a store call took longer than ``store_timeout_seconds``
    ├── LockLostError              another request took this request's key over
    └── ConfigurationError         an option is invalid (also a ``ValueError``)
        └── UnguardedRequestError  an ``@idempotent`` endpoint was called for a request
                                   no guard saw (the app is wired so that it is not guarded)

Request-level problems (missing key, mismatch, in progress) are not exceptions: the middleware
answers them with HTTP responses.
"""

from __future__ import annotations


class IdempotencyError(Exception):
    """Base class of every error this library raises."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class StoreError(IdempotencyError):
    """The idempotency store could not be reached or answered with an error."""


class StoreTimeoutError(StoreError, TimeoutError):
    """The idempotency store did not answer within the configured timeout."""


class LockLostError(IdempotencyError):
    """Another request took over this request's idempotency key; stop before any side effect."""


class ConfigurationError(IdempotencyError, ValueError):
    """An idempotency option has an invalid value."""


class UnguardedRequestError(ConfigurationError):
    """An ``@idempotent`` endpoint was called for an HTTP request that no
    ``IdempotencyMiddleware`` guarded; it was not run."""
