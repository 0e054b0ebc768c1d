"""A real uvicorn process serving one of the test apps, on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal, Self

from starlette_idempotency.testing._process import Managed, free_port, stop_process, wait_until

HttpImplementation = Literal["h11", "httptools"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class UvicornServer(Managed):
    """``python -m uvicorn APP`` in a child process, run from the repository's root; ``app`` is
    a ``module:attribute`` path (an app factory with ``factory=True``)."""

    def __init__(
        self,
        app: str,
        *,
        http: HttpImplementation = "h11",
        env: dict[str, str] | None = None,
        factory: bool = False,
    ) -> None:
        self.app = app
        self.http = http
        self.env = env or {}
        self.factory = factory
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self.port = free_port()
        command = [sys.executable, "-m", "uvicorn", self.app, "--port", str(self.port)]
        command += ["--http", self.http, "--log-level", "warning", "--lifespan", "on"]
        command += ["--factory"] if self.factory else []
        self._proc = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **self.env})
        proc = self._proc
        wait_until(
            lambda: proc.poll() is not None or _accepts(self.port),
            timeout=20,
            what=f"uvicorn serving {self.app}",
        )
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn serving {self.app} exited with {proc.returncode}")
        return self

    def close(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None
