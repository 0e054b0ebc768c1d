"""Runnable examples of starlette-idempotency (not part of the installed package)."""

from __future__ import annotations
