"""Real uvicorn servers on a free loopback port: a child process serving one of the test apps
(:class:`UvicornServer`), or a thread of the test process serving an app object
(:func:`uvicorn_thread`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Self

import uvicorn
from starlette.types import ASGIApp

from starlette_idempotency.testing._processes import Managed, free_port, stop_process
from tests.support.conditions import eventually_sync

HttpImplementation = Literal["h11", "httptools"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _accepts(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


class UvicornServer(Managed):
    """``python -m uvicorn APP`` in a child process, run from the repository's root; ``app`` is
    a ``module:attribute`` path (an app factory with ``factory=True``), served by ``workers``
    worker processes."""

    def __init__(
        self,
        app: str,
        *,
        http: HttpImplementation = "h11",
        env: dict[str, str] | None = None,
        factory: bool = False,
        workers: int = 1,
    ) -> None:
        self.app = app
        self.workers = workers
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
        command += ["--workers", str(self.workers)] if self.workers > 1 else []
        self._proc = subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, **self.env})
        proc = self._proc
        eventually_sync(
            lambda: proc.poll() is not None or _accepts(self.port),
            timeout=20,
            interval=0.05,
            message=f"uvicorn serving {self.app}",
        )
        if proc.poll() is not None:
            raise RuntimeError(f"uvicorn serving {self.app} exited with {proc.returncode}")
        return self

    def close(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None


@contextmanager
def uvicorn_thread(app: ASGIApp) -> Iterator[str]:
    """``app`` served by uvicorn in a background thread; yields its base URL. The socket is
    bound here, so there is no race for the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="off",
        ws="none",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def serving() -> bool:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during startup")
        return server.started and _accepts(port, timeout=1.0)

    try:
        eventually_sync(serving, timeout=10.0, message=f"uvicorn to answer on port {port}")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
