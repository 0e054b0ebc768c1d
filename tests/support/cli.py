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


def assert_unreachable(ran: Ran, where: str, error_start: str, *, secret: str) -> None:
    """``doctor`` on a store it cannot reach at ``where``: exit 1, one error line beginning with
    ``error_start``, the summary, and never the password ``secret``."""
    assert ran.code == 1, ran.out + ran.err
    assert ran.lines[0] == f"doctor: checking {where}"
    assert len(ran.lines) == 3, ran.out
    assert ran.lines[1].startswith(error_start)
    assert ran.lines[2] == (
        "doctor: 1 error, 0 warnings: fix the errors before the app uses this store"
    )
    assert secret not in ran.out + ran.err
