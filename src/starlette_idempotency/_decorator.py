"""The ``@idempotent`` decorator: a route's option overrides, and the endpoint's guard check.

The decorator records which options a route overrides; the middleware merges them over its own
defaults once per route. In the documented order (``@app.post(...)`` above ``@idempotent(...)``)
the decorator also wraps the endpoint. The wrapper runs on every call, so it checks that a
router's call comes with a request a guard saw (``_marks.enter_endpoint``) and tells the
middleware when the endpoint itself began, which tells a FastAPI validation 422 or an auth
dependency's 401 (nothing ran) from a handler's own 4xx (a business outcome).

The wrapper keeps the endpoint's signature, so FastAPI's introspection and OpenAPI see the
original function, with one parameter more: an ``HTTPConnection``, which FastAPI fills with the
request (and documents nowhere). A Starlette endpoint gets its request as an argument already;
a direct call, as a unit test makes, passes neither and runs as the function would.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, Unpack, cast, overload

from starlette.requests import HTTPConnection

from starlette_idempotency._marks import enter_endpoint
from starlette_idempotency._openapi_install import hook_fastapi
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
#: The keyword the wrapper's signature adds for FastAPI to fill with the request.
CONNECTION_PARAMETER = "__idempotency_connection"

# What a route's options are checked against when the decorator runs (see idempotent()).
_LOOSEST = IdempotencyPolicy(ttl_hours=1e9, lock_ttl_seconds=1e-9)


def _is_connection_annotation(annotation: Any) -> bool:
    """Whether FastAPI fills a parameter so annotated with the request."""
    if isinstance(annotation, str):  # postponed, and not evaluable yet: judged by its name
        return annotation.rpartition(".")[2] in ("Request", "HTTPConnection")
    return isinstance(annotation, type) and issubclass(annotation, HTTPConnection)


def _with_connection(func: Callable[..., Any]) -> tuple[inspect.Signature | None, str | None]:
    """The wrapper's signature, and the keyword FastAPI will pass the request as.

    When ``func`` declares a ``Request`` (or ``HTTPConnection``) parameter, the wrapper reads
    the request there and keeps the signature; otherwise it adds a keyword-only
    ``HTTPConnection`` parameter of its own. ``(None, None)`` when ``func`` has no signature.
    """
    try:
        try:
            signature = inspect.signature(func, eval_str=True)
        except NameError:  # a forward reference FastAPI resolves later
            signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None, None
    parameters = list(signature.parameters.values())
    for parameter in parameters:
        if _is_connection_annotation(parameter.annotation):
            return None, parameter.name
    added = inspect.Parameter(
        CONNECTION_PARAMETER, inspect.Parameter.KEYWORD_ONLY, annotation=HTTPConnection
    )
    at = len(parameters)
    if parameters and parameters[-1].kind is inspect.Parameter.VAR_KEYWORD:
        at -= 1  # keyword-only parameters go before **kwargs
    parameters.insert(at, added)
    return signature.replace(parameters=parameters), CONNECTION_PARAMETER


def _connection(args: tuple[Any, ...], kwargs: dict[str, Any], keyword: str | None) -> Any:
    """The request a router called the endpoint with, if any: FastAPI's keyword, or the
    positional request of a Starlette endpoint (after ``self`` for an ``HTTPEndpoint``)."""
    if keyword == CONNECTION_PARAMETER:
        connection = kwargs.pop(CONNECTION_PARAMETER, None)
        if connection is not None:
            return connection
    elif keyword is not None and isinstance(kwargs.get(keyword), HTTPConnection):
        return kwargs[keyword]
    for arg in args[:2]:
        if isinstance(arg, HTTPConnection):
            return arg
    return None


def _wrap_marking_start(func: _F) -> _F:
    signature, keyword = _with_connection(func)
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            enter_endpoint(async_wrapper, _connection(args, kwargs, keyword))
            return await func(*args, **kwargs)

        wrapper: Callable[..., Any] = async_wrapper
    else:

        @functools.wraps(func)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            enter_endpoint(sync_wrapper, _connection(args, kwargs, keyword))
            return func(*args, **kwargs)

        wrapper = sync_wrapper
    if signature is not None:
        wrapper.__signature__ = signature  # type: ignore[attr-defined]
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

    hook_fastapi()  # FastAPI may have been imported after this package

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
