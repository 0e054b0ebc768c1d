"""Starting processes for tests: free ports, waiting on a condition, finding and stopping
server binaries. The throwaway Redis and PostgreSQL launchers, the pytest plugin behind them
and the project's own tests and benchmarks build on it; it is private, not an API.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self


def free_port(*, also_free: Sequence[int] = ()) -> int:
    """A TCP port on 127.0.0.1 that is free now, and whose ``port + offset`` for each offset
    in ``also_free`` is free too (Redis Cluster needs its bus port at port + 10000)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port + max(also_free, default=0) < 65536 and all(
            port_is_free(port + offset) for offset in also_free
        ):
            return port
    raise RuntimeError("no free port found")


def port_is_free(port: int) -> bool:
    """Whether nothing listens on (or holds) ``port`` on 127.0.0.1 now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_until(
    condition: Callable[[], bool], *, timeout: float, interval: float = 0.05, what: str = ""
) -> None:
    """Poll ``condition`` until it is true; raise ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


#: Where server binaries live besides PATH (Debian puts nginx in /usr/sbin).
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin")


def find_binary(name: str, search: Sequence[str] = SBIN_DIRS) -> str | None:
    """The path of an executable, looked up on PATH and then in ``search``; ``None`` if absent."""
    found = shutil.which(name)
    if found:
        return found
    for directory in search:
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def require_binary(name: str, *, hint: str, search: Sequence[str] = SBIN_DIRS) -> str:
    """Like :func:`find_binary`, but raise ``FileNotFoundError`` with an install hint."""
    found = find_binary(name, search)
    if found is None:
        raise FileNotFoundError(f"{name} not found; install it: {hint}")
    return found


class Managed:
    """Something started with :meth:`start` and torn down with :meth:`close`, usable as a
    context manager (torn down too when starting fails half-way)."""

    def start(self) -> Self:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def stop_process(proc: subprocess.Popen[bytes], *, timeout: float = 10.0) -> None:
    """Terminate a child process, killing it if it does not exit within ``timeout``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
