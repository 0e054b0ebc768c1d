"""Throwaway ``redis-server`` processes for tests: a single server and a three-node Cluster.

Nothing here needs Docker or the redis-py driver: servers are local binaries on free ports in
temporary directories, with persistence off, and readiness is polled over a raw socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from starlette_idempotency.testing._processes import (
    Managed,
    free_port,
    require_binary,
    stop_process,
    wait_until,
)

_INSTALL_HINT = "apt-get install redis-server (or brew install redis)"
_START_TIMEOUT = 15.0
_CLUSTER_BUS_OFFSET = 10000


def encode_command(*args: str) -> bytes:
    """One command in the Redis protocol (RESP), ready for a raw socket."""
    parts = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def redis_command(port: int, *args: str, timeout: float = 2.0) -> bytes:
    """Send one command to ``127.0.0.1:port`` and return its raw reply (simple replies only:
    status, error, integer, or one bulk string). Raises ``OSError`` when nobody answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(encode_command(*args))
        reply = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("connection closed before the full reply")
            reply += chunk
            if reply.startswith(b"$") and b"\r\n" in reply:
                header, _, rest = reply.partition(b"\r\n")
                size = int(header[1:])
                if size < 0:
                    return b""
                if len(rest) >= size + 2:
                    return rest[:size]
            elif reply.endswith(b"\r\n"):
                return reply


def _answers_ping(port: int) -> bool:
    try:
        return redis_command(port, "PING", timeout=0.5).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(Managed):
    """A private ``redis-server`` on a free port (or ``port``), persistence off.

    Use it as a context manager or call :meth:`start` and :meth:`close`. :meth:`stop` and
    :meth:`start` again keep the port, for outage tests; :meth:`freeze` and :meth:`thaw` stop
    and resume the process (SIGSTOP / SIGCONT) to simulate a hung server.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        also_free: Sequence[int] = (),
    ) -> None:
        self.binary = require_binary("redis-server", hint=_INSTALL_HINT, search=["/usr/sbin"])
        self.port = port if port is not None else free_port(also_free=also_free)
        self.extra_args = list(extra_args)
        self._tmp = tempfile.TemporaryDirectory(prefix=f"redis-{self.port}-")
        self.directory = Path(self._tmp.name)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The process id while the server runs (for ``/proc`` inspection in tests)."""
        return self._proc.pid if self.running and self._proc is not None else None

    def start(self) -> RedisServer:
        """Start the server (again) and wait until it answers ``PING``."""
        if self.running:
            return self
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            *self.extra_args,
        ]
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        try:
            wait_until(
                self._ready, timeout=_START_TIMEOUT, what=f"redis-server on port {self.port}"
            )
        except TimeoutError:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            log = (self.directory / "redis.log").read_text(errors="replace")
            raise RuntimeError(f"redis-server on port {self.port} exited:\n{log}")
        if not _answers_ping(self.port):
            return False
        # Another server on the port answers too, while this one has yet to find the port
        # taken and exit: only its own process id says it is this one.
        assert self._proc is not None
        return f"process_id:{self._proc.pid}\r\n".encode() in self.command("INFO", "server")

    def stop(self) -> None:
        """Stop the server; :meth:`start` brings it back on the same port."""
        if self._proc is not None:
            self.thaw()
            stop_process(self._proc)
            self._proc = None

    def freeze(self) -> None:
        """Suspend the process: connections stay open and nothing answers."""
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Resume a frozen process."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def command(self, *args: str) -> bytes:
        """One command's raw reply (see :func:`redis_command`)."""
        return redis_command(self.port, *args)

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        self._tmp.cleanup()


class RedisClusterServers(Managed):
    """Three ``redis-server --cluster-enabled yes`` primaries, no replicas, all slots covered.

    Each node's bus port (port + 10000) is free too. ``urls`` / ``ports`` list the nodes;
    any one of them is a valid startup node for ``redis.asyncio.RedisCluster``.
    """

    def __init__(self, nodes: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        used: set[int] = set()
        for _ in range(nodes):
            port = free_port(also_free=(_CLUSTER_BUS_OFFSET,))
            while port in used or port + _CLUSTER_BUS_OFFSET in used:
                port = free_port(also_free=(_CLUSTER_BUS_OFFSET,))
            used.update((port, port + _CLUSTER_BUS_OFFSET))
            self.nodes.append(
                RedisServer(
                    port=port,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        "5000",
                    ],
                )
            )

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}" for port in self.ports]

    @property
    def url(self) -> str:
        """The first node's URL, a startup node for the cluster client."""
        return self.urls[0]

    def start(self) -> RedisClusterServers:
        """Start the nodes, join them into one cluster and wait for ``cluster_state:ok``."""
        cli = require_binary("redis-cli", hint=_INSTALL_HINT, search=["/usr/sbin"])
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{port}" for port in self.ports),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                timeout=60,
            )
            wait_until(self._all_ok, timeout=30, what="cluster_state:ok on every node")
        except BaseException:
            self.close()
            raise
        return self

    def _all_ok(self) -> bool:
        for node in self.nodes:
            try:
                info = node.command("CLUSTER", "INFO")
            except OSError:
                return False
            if (
                b"cluster_state:ok" not in info
                or f"cluster_known_nodes:{len(self.nodes)}".encode() not in info
            ):
                return False
        return True

    def close(self) -> None:
        for node in self.nodes:
            node.close()


__all__ = ["RedisClusterServers", "RedisServer", "encode_command", "redis_command"]
