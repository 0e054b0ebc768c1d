"""Shared type aliases and the clock protocol (standard library only)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_HEADER_NAME = "Idempotency-Key"
REPLAY_HEADER = "X-Idempotent-Replay"
#: The replay header of Stripe's API and of the peers that follow it (``replay_header_name``).
STRIPE_REPLAY_HEADER = "Idempotent-Replayed"


class Clock(Protocol):
    """Wall-clock time in seconds since the epoch; injectable so tests need no sleeps."""

    def __call__(self) -> float: ...


def system_clock() -> float:
    """The real wall clock."""
    return time.time()
