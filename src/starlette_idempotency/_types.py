"""Shared type aliases, the clock protocol and the HTTP names (standard library and the
package's errors only)."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from starlette_idempotency.errors import ConfigurationError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
#: A request body as the middleware holds it: the one message's ``bytes`` it came in, or the
#: ``bytearray`` the chunks of several were gathered in (one copy, never a list and its join).
Body = bytes | bytearray

#: An HTTP field name or method (RFC 9110 "token").
HTTP_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

DEFAULT_HEADER_NAME = "Idempotency-Key"
REPLAY_HEADER = "X-Idempotent-Replay"
#: The replay header of Stripe's API and of the peers that follow it (``replay_header_name``).
STRIPE_REPLAY_HEADER = "Idempotent-Replayed"


def checked_header_name(option: str, name: object, example: str) -> str:
    """``name``, the value of the option ``option`` that names an HTTP header (the middleware's
    ``header_name``, its ``replay_header_name``, the CLI's ``--replay-header-name``); refused
    unless it is one, with ``example`` shown."""
    if not isinstance(name, str) or not HTTP_TOKEN.fullmatch(name):
        raise ConfigurationError(
            f"{option} must be an HTTP header name such as {example!r}, not {name!r}"
        )
    return name


class Clock(Protocol):
    """Wall-clock time in seconds since the epoch; injectable so tests need no sleeps.

    Wall time is only ever shown (a record's ``created_at``, a checkpoint's time): durations
    are measured on a monotonic clock (see :func:`monotonic_for`), and leases and locks on the
    store's own clock.
    """

    def __call__(self) -> float: ...


#: The real wall clock (``time.time`` itself: reading it costs no call of ours).
system_clock: Clock = time.time


def monotonic_for(clock: Clock) -> Callable[[], float]:
    """The monotonic clock that measures durations beside the wall clock ``clock``.

    The clock's own ``monotonic`` when it has one (``FakeClock`` does, so that a test can step
    its wall time alone), ``time.monotonic`` beside the system clock, else ``clock`` itself: an
    injected clock with no monotonic twin keeps driving durations, as a test that advances it
    to expire a lock expects.
    """
    monotonic = getattr(clock, "monotonic", None)
    if callable(monotonic):
        return monotonic  # type: ignore[no-any-return]
    if clock is system_clock:
        return time.monotonic
    return clock
