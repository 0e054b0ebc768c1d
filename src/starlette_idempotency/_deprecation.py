"""What is on its way out: every deprecated name and spelling warns, naming the release that
removes it (standard library only: the client imports the package root too)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: The release that removes every deprecated name and spelling of 0.2.
REMOVED_IN = "0.3.0"


def deprecated(message: str, *, stacklevel: int = 3) -> None:
    """Warn that what ``message`` describes is removed in :data:`REMOVED_IN` (``stacklevel``
    as ``warnings.warn`` counts it from the caller of this function's caller)."""
    warnings.warn(
        f"{message}; it is removed in {REMOVED_IN}", DeprecationWarning, stacklevel=stacklevel
    )


def moved(name: str, module: str, home: str) -> Any:
    """``name`` as a module's ``__getattr__`` hands it out where it no longer lives: from its
    ``home``, with a warning for whoever imported it from ``module``."""
    deprecated(f"import {name} from {home}, not from {module}", stacklevel=4)
    return getattr(importlib.import_module(home), name)
