"""Running the ``starlette-idempotency`` command as a user would: a child process, its exit code
and output, with no service URL inherited from the test run's environment."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


def run(*command: str, env: dict[str, str] | None = None) -> Ran:
    """``command`` in a child process; ``env`` is added to an environment without the run's
    ``DATABASE_URL`` and ``REDIS_URL``."""
    environment = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    environment.update(env or {})
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=60, check=False
    )
    return Ran(done.returncode, done.stdout, done.stderr)


def cli(*args: str, env: dict[str, str] | None = None) -> Ran:
    """``python -m starlette_idempotency.cli ARGS``."""
    return run(sys.executable, "-m", "starlette_idempotency.cli", *args, env=env)
