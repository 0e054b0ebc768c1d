"""A throwaway PostgreSQL server for tests: ``initdb`` + ``pg_ctl`` in a temporary directory.

Trust authentication on 127.0.0.1 and a Unix socket inside the temporary directory, durability
switched off (fsync, synchronous_commit) because the data is thrown away. PostgreSQL refuses to
run as root, so as root the server runs as the ``postgres`` system user (via ``runuser``).
:meth:`PostgresServer.stop` and :meth:`PostgresServer.start` keep the data and the port, for
outage tests::

    with PostgresServer() as server:
        store = await PostgresStore.connect(server.dsn)
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from starlette_idempotency.testing._processes import (
    Managed,
    free_port,
    require_binary,
    wait_until,
)

_INSTALL_HINT = "apt-get install postgresql"
_SERVER_SETTINGS = (
    "fsync=off",
    "synchronous_commit=off",
    "full_page_writes=off",
    "max_connections=200",
    "listen_addresses=127.0.0.1",
)


def postgres_bin_dirs() -> list[str]:
    """Debian's versioned binary directories, newest version first (they are not on PATH)."""
    found = glob.glob("/usr/lib/postgresql/*/bin")

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path))

    return sorted(found, key=version, reverse=True)


class PostgresServer(Managed):
    """One PostgreSQL server on a free port, started on construction's first :meth:`start`.

    ``dsn`` connects as the ``postgres`` superuser to the ``postgres`` database.
    """

    def __init__(self, *, port: int | None = None, startup_timeout: float = 30.0) -> None:
        search = postgres_bin_dirs()
        self._initdb = require_binary("initdb", hint=_INSTALL_HINT, search=search)
        bindir = os.path.dirname(self._initdb)
        self._pg_ctl = require_binary("pg_ctl", hint=_INSTALL_HINT, search=[bindir, *search])
        self._pg_isready = require_binary("pg_isready", hint=_INSTALL_HINT, search=[bindir])
        self.port = port if port is not None else free_port()
        self._startup_timeout = startup_timeout
        self._as_user: list[str] = []
        self._root = Path(tempfile.mkdtemp(prefix="starlette-idempotency-pg-"))
        if os.geteuid() == 0:
            self._as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self._root, user="postgres", group="postgres")
        self._datadir = self._root / "data"
        self._logfile = self._root / "server.log"
        self._initialised = False
        self.running = False

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60.0) -> None:
        done = subprocess.run(
            [*self._as_user, *args], capture_output=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{os.path.basename(args[0])} failed ({done.returncode}): "
                f"{done.stderr.decode(errors='replace').strip()}\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self._logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _accepting(self) -> bool:
        # This server's own word that it is ready on its port (postmaster.pid: the port on
        # its 4th line, the state on its 8th): another PostgreSQL on the port would answer
        # pg_isready while this one has yet to find the port taken and exit.
        try:
            lines = (self._datadir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        if len(lines) < 8 or lines[3].strip() != str(self.port) or lines[7].strip() != "ready":
            return False
        done = subprocess.run(
            [self._pg_isready, "-q", "-h", "127.0.0.1", "-p", str(self.port), "-t", "1"],
            capture_output=True,
            check=False,
        )
        return done.returncode == 0

    def start(self) -> PostgresServer:
        """Initialise the data directory (first time only), start, and wait for connections."""
        if self.running:
            return self
        if not self._initialised:
            self._run(
                self._initdb,
                "-D",
                str(self._datadir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            )
            self._initialised = True
        options = " ".join(
            [f"-p {self.port}", f"-k {self._root}", *(f"-c {s}" for s in _SERVER_SETTINGS)]
        )
        self._run(
            self._pg_ctl,
            "start",
            "--no-wait",
            "-D",
            str(self._datadir),
            "-l",
            str(self._logfile),
            "-o",
            options,
        )
        self.running = True
        try:
            wait_until(
                self._accepting, timeout=self._startup_timeout, what=f"PostgreSQL on {self.port}"
            )
        except TimeoutError as exc:
            tail = self.log_tail()
            with contextlib.suppress(RuntimeError):
                self.stop(mode="immediate")
            self.running = False  # or never was: another server held the port
            raise TimeoutError(f"{exc}; server log:\n{tail}") from exc
        return self

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server (``fast`` disconnects clients; ``immediate`` is a crash)."""
        if not self.running:
            return
        self._run(self._pg_ctl, "stop", "-D", str(self._datadir), "-m", mode, "-w")
        self.running = False

    def close(self) -> None:
        """Stop the server and delete its data."""
        try:
            self.stop(mode="immediate")
        finally:
            shutil.rmtree(self._root, ignore_errors=True)


__all__ = ["PostgresServer", "postgres_bin_dirs"]
