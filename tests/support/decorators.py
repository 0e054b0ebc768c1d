"""A decorator of the kind users stack above ``@idempotent``: a rate limiter or a cache written
with ``functools.wraps``, which copies the name, the attributes and ``__wrapped__``."""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any


def counting_wraps(runs: Counter[str]) -> Callable[[Any], Any]:
    """A ``functools.wraps`` decorator (sync or async, as the function) that counts each call
    as ``runs["limiter"]``."""

    def rate_limited(func: Any) -> Any:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def limited(*args: Any, **kwargs: Any) -> Any:
                runs["limiter"] += 1
                return await func(*args, **kwargs)

            return limited

        @functools.wraps(func)
        def limited_sync(*args: Any, **kwargs: Any) -> Any:
            runs["limiter"] += 1
            return func(*args, **kwargs)

        return limited_sync

    return rate_limited
