"""The ``@idempotent`` decorator: a route's option overrides, and the endpoint's start mark.

The decorator records which options a route overrides; the middleware merges them over its own
defaults once per route. In the documented order (``@app.post(...)`` above ``@idempotent(...)``)
the decorator also wraps the endpoint so the middleware learns when the endpoint itself began,
which tells a FastAPI validation 422 or an auth dependency's 401 (nothing ran) from a handler's
own 4xx (a business outcome). The wrapper keeps the endpoint's signature, so FastAPI's
introspection and OpenAPI see the original function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, Unpack, cast, overload

from starlette_idempotency._marks import note_endpoint_started
from starlette_idempotency._options import (
    ROUTE_OPTIONS,
    IdempotencyPolicy,
    RouteOptions,
    unknown_option_error,
)
from starlette_idempotency.errors import ConfigurationError

_F = TypeVar("_F", bound=Callable[..., Any])

POLICY_ATTRIBUTE = "__idempotency_overrides__"
MARKS_START_ATTRIBUTE = "__idempotency_marks_start__"

# What a route's options are checked against when the decorator runs (see idempotent()).
_LOOSEST = IdempotencyPolicy(ttl_hours=1e9, lock_ttl_seconds=1e-9)


def _wrap_marking_start(func: _F) -> _F:
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            note_endpoint_started()
            return await func(*args, **kwargs)

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            note_endpoint_started()
            return func(*args, **kwargs)

        wrapper = sync_wrapper
    setattr(wrapper, MARKS_START_ATTRIBUTE, True)
    return cast(_F, wrapper)


@overload
def idempotent(func: _F, /) -> _F: ...


@overload
def idempotent(func: None = None, /, **options: Unpack[RouteOptions]) -> Callable[[_F], _F]: ...


def idempotent(func: Any = None, /, **options: Any) -> Any:
    """Make a POST/PATCH endpoint idempotent under :class:`IdempotencyMiddleware`.

    Every option left out takes the middleware's value; the documentation's options reference
    describes each. Put it below ``@app.post(...)``; bare ``@idempotent`` takes every option
    from the middleware::

        @app.post("/payments")
        @idempotent(ttl_hours=48, lock_ttl_seconds=60)
        async def pay(body: Payment) -> Receipt: ...
    """
    if func is not None and not callable(func):
        raise ConfigurationError(
            f"@idempotent takes its options by name, e.g. @idempotent(ttl_hours=48), not {func!r}"
        )
    unknown = options.keys() - ROUTE_OPTIONS
    if unknown:
        raise unknown_option_error(unknown, ROUTE_OPTIONS, "@idempotent")
    given = {name: value for name, value in options.items() if value is not None}
    # Validate now, at import time, and keep the normalised values. Whether the lock outlives
    # the retention depends on the middleware's values too: merged with the loosest ones here,
    # it is checked with the real ones at startup.
    validated = _LOOSEST.merged(given)
    overrides = {name: getattr(validated, name) for name in given}

    def decorate(func: _F) -> _F:
        # Set on the function itself too: in the reverse order the router already holds it.
        setattr(func, POLICY_ATTRIBUTE, overrides)
        wrapper = _wrap_marking_start(func)
        setattr(wrapper, POLICY_ATTRIBUTE, overrides)
        return wrapper

    return decorate if func is None else decorate(func)


def misplaced_decorator_error(template: str) -> ConfigurationError:
    """``@idempotent`` above the route decorator: the router holds the undecorated endpoint,
    so the middleware could not tell a validation 422 from the handler's own."""
    return ConfigurationError(
        f"@idempotent is above the route decorator on {template}; put it below, so that it "
        f"wraps the endpoint the router calls:\n\n"
        f'    @app.post("{template}")\n    @idempotent(...)\n    async def endpoint(...): ...'
    )
