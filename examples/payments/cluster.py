"""Launcher for the payments demo: Redis, PostgreSQL, two uvicorn pods and nginx, all local.

Command line (from the repository root)::

    python -m examples.payments.cluster up [--store redis|postgres] [--detach] [--crash-hooks]
    python -m examples.payments.cluster status [--url]
    python -m examples.payments.cluster down

``up`` starts Redis and PostgreSQL unless ``REDIS_URL`` / ``DATABASE_URL`` are set, creates
the demo database, starts "pod-a" and "pod-b" and nginx on free ports, waits until every part
answers, prints the URLs and runs in the foreground until Ctrl-C; ``--detach`` leaves it
running in the background; ``--crash-hooks`` lets ``X-Demo-Crash: after-commit`` kill a pod
(``DEMO_CRASH_HOOKS=1``). ``down`` stops a running ``up`` through the state file
``.demo/state.json`` (logs are kept in ``.demo/logs/``).

Python API, used by the end-to-end tests::

    with Cluster(store="redis", payments_lock_ttl_seconds=2) as cluster:
        cluster.url                  # nginx
        cluster.pods["pod-a"].url    # one pod directly
        cluster.kill_pod("pod-a")    # SIGKILL
        cluster.start_pod("pod-a")   # again, on the same port
        cluster.stop_redis(); cluster.start_redis()

``env={CRASH_HOOKS: "1"}`` lets ``X-Demo-Crash: after-commit`` kill a pod after its commit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from examples.payments.nginx import render_local
from starlette_idempotency.testing._postgres_server import PostgresServer, postgres_bin_dirs
from starlette_idempotency.testing._processes import (
    SBIN_DIRS,
    Managed,
    find_binary,
    free_port,
    stop_process,
    wait_until,
)
from starlette_idempotency.testing._redis_server import RedisServer, redis_command

StoreKind = Literal["redis", "postgres"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STATE_DIR = REPO_ROOT / ".demo"
POD_NAMES = ("pod-a", "pod-b")
#: The pods' switch for ``X-Demo-Crash`` (off unless asked for).
CRASH_HOOKS = "DEMO_CRASH_HOOKS"
DATABASE_NAME = "payments"

INSTALL_HINTS = {
    "nginx": "apt-get install nginx-light (or: apt-get install nginx)",
    "redis-server": "apt-get install redis-server (or set REDIS_URL)",
    "initdb": "apt-get install postgresql (or set DATABASE_URL)",
}

_T = TypeVar("_T")


class ClusterError(RuntimeError):
    """A part of the demo did not start."""


def missing_binaries(*, need_redis: bool, need_postgres: bool) -> list[str]:
    """One line per missing program, each saying what to install."""
    wanted = ["nginx"]
    if need_redis:
        wanted.append("redis-server")
    if need_postgres:
        wanted.append("initdb")
    search = {"initdb": postgres_bin_dirs()}
    return [
        f"{name} not found: {INSTALL_HINTS[name]}"
        for name in wanted
        if find_binary(name, search.get(name, SBIN_DIRS)) is None
    ]


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def _run_async(make: Callable[[], Any]) -> Any:
    """Run a coroutine to completion in a thread of its own (callers may be inside a loop)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(lambda: asyncio.run(make())).result()


def _admin_sql(dsn: str, *statements: str) -> list[Any]:
    """Run statements on one connection; returns each one's first value."""
    import asyncpg  # type: ignore[import-untyped]

    async def run() -> list[Any]:
        connection = await asyncpg.connect(dsn, timeout=30)
        try:
            return [await connection.fetchval(statement) for statement in statements]
        finally:
            await connection.close()

    return cast(list[Any], _run_async(run))


def dsn_with_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path=f"/{database}"))


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _spawn(args: Sequence[str], *, log_path: Path, env: Mapping[str, str] | None = None) -> Any:
    """Start a child in a session of its own (a terminal's Ctrl-C reaches only the launcher,
    which then stops everything in order), output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(args),
            cwd=REPO_ROOT,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class Pod:
    """One uvicorn process running the demo app."""

    name: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Cluster(Managed):
    """The whole demo on this machine; a context manager that stops all it started.

    ``redis_url`` / ``database_url`` use servers that are already running (they are never
    stopped); without them a private ``redis-server`` and PostgreSQL server are started on
    free ports. ``store="postgres"`` runs the pods on PostgresStore alone, without Redis.
    ``payments_lock_ttl_seconds`` shortens the lock of ``POST /payments`` (default 60 s).
    """

    def __init__(
        self,
        *,
        store: StoreKind = "redis",
        redis_url: str | None = None,
        database_url: str | None = None,
        state_dir: Path | str | None = None,
        pod_names: Sequence[str] = POD_NAMES,
        payments_lock_ttl_seconds: float | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        if store not in ("redis", "postgres"):
            raise ValueError(f"store must be 'redis' or 'postgres', not {store!r}")
        self.store: StoreKind = store
        self._own_state_dir = state_dir is None
        self.state_dir = (
            Path(tempfile.mkdtemp(prefix="payments-demo-"))
            if state_dir is None
            else Path(state_dir).resolve()
        )
        self.log_dir = self.state_dir / "logs"
        self._given_redis_url = redis_url
        self._given_database_url = database_url
        self.redis_url: str | None = redis_url if store == "redis" else None
        self.database_url = database_url or ""
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self.postgres_data_dir: str | None = None
        self.pods = {name: Pod(name, 0, self.log_dir / f"{name}.log") for name in pod_names}
        self.nginx_port = 0
        self.nginx: subprocess.Popen[bytes] | None = None
        self._payments_lock_ttl = payments_lock_ttl_seconds
        self._extra_env = dict(env or {})
        self._startup_timeout = startup_timeout
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """nginx, round-robin over the pods."""
        return f"http://127.0.0.1:{self.nginx_port}"

    def missing_binaries(self) -> list[str]:
        return missing_binaries(
            need_redis=self.store == "redis" and self._given_redis_url is None,
            need_postgres=self._given_database_url is None,
        )

    def start(self) -> Cluster:
        missing = self.missing_binaries()
        if missing:
            raise ClusterError("\n".join(missing))
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            # nginx workers run as an unprivileged user when started by root: let them in.
            self.state_dir.chmod(0o755)
            self.log_dir.mkdir(exist_ok=True)
            self._start_redis_server()
            self._start_postgres_server()
            self._start_all_pods()
            self._start_nginx()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop everything this cluster started (servers given by URL stay up)."""
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], None]] = [self._stop_nginx]
        steps += [functools.partial(self._stop_pod_process, pod) for pod in self.pods.values()]
        if self.redis is not None:
            steps.append(self.redis.close)
        if self.postgres is not None:
            steps.append(self.postgres.close)
        errors: list[BaseException] = []
        for step in steps:
            try:
                step()
            except Exception as exc:  # go on stopping the rest
                errors.append(exc)
        if self._own_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        if errors:
            raise ClusterError(f"cleanup failed: {errors!r}") from errors[0]

    # --- Redis and PostgreSQL ----------------------------------------------------------------

    def _start_redis_server(self) -> None:
        if self.store != "redis" or self._given_redis_url is not None:
            return
        self.redis = RedisServer()
        self.redis.start()
        self.redis_url = self.redis.url

    def _start_postgres_server(self) -> None:
        if self._given_database_url is not None:
            return
        self.postgres = PostgresServer()
        self.postgres.start()
        admin = self.postgres.dsn
        _admin_sql(admin, f"CREATE DATABASE {DATABASE_NAME}")
        self.postgres_data_dir = str(_admin_sql(admin, "SHOW data_directory")[0])
        self.database_url = dsn_with_database(admin, DATABASE_NAME)

    def stop_redis(self) -> None:
        """Stop the private Redis (an outage); :meth:`start_redis` brings it back, empty."""
        self._own_redis().stop()

    def start_redis(self) -> None:
        self._own_redis().start()

    def _own_redis(self) -> RedisServer:
        if self.redis is None:
            raise ClusterError("this cluster did not start Redis, so it does not stop it")
        return self.redis

    # --- pods --------------------------------------------------------------------------------

    def _pod_env(self, pod: Pod) -> dict[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if name not in ("REDIS_URL", "DATABASE_URL", "IDEMPOTENCY_STORE", "POD_ID")
        }
        env.update(
            PYTHONUNBUFFERED="1",
            POD_ID=pod.name,
            DATABASE_URL=self.database_url,
            IDEMPOTENCY_STORE=self.store,
        )
        if self.redis_url is not None:
            env["REDIS_URL"] = self.redis_url
        if self._payments_lock_ttl is not None:
            env["PAYMENTS_LOCK_TTL_SECONDS"] = str(self._payments_lock_ttl)
        env.update(self._extra_env)
        return env

    def _spawn_pod(self, pod: Pod) -> None:
        pod.process = _spawn(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "examples.payments.app:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(pod.port),
                "--no-access-log",
                "--log-level",
                "warning",
                "--timeout-graceful-shutdown",
                "5",
            ],
            log_path=pod.log_path,
            env=self._pod_env(pod),
        )

    def _wait_pod(self, pod: Pod, timeout: float) -> None:
        def healthy() -> bool:
            if pod.process is None or pod.process.poll() is not None:
                raise ClusterError(f"{pod.name} exited on startup:\n{_tail(pod.log_path)}")
            return http_ok(f"{pod.url}/healthz")

        wait_until(healthy, timeout=timeout, interval=0.1, what=f"{pod.name} on {pod.url}")

    def _start_all_pods(self, attempts: int = 3) -> None:
        pending = list(self.pods.values())
        for attempt in range(attempts):
            for pod in pending:
                pod.port = free_port()
                self._spawn_pod(pod)
            failed = []
            for pod in pending:
                try:
                    self._wait_pod(pod, self._startup_timeout)
                except ClusterError:
                    # Another process may have taken the free port in between: new port.
                    if attempt == attempts - 1 or "address already in use" not in _tail(
                        pod.log_path
                    ):
                        raise
                    failed.append(pod)
            pending = failed
            if not pending:
                return

    def start_pod(self, name: str) -> None:
        """Start a stopped or killed pod again, on its old port, and wait until it answers."""
        pod = self.pods[name]
        if pod.running:
            return
        self._spawn_pod(pod)
        self._wait_pod(pod, self._startup_timeout)

    def kill_pod(self, name: str) -> None:
        """SIGKILL a pod: a crash, nothing in the process gets to clean up."""
        pod = self.pods[name]
        if pod.process is not None and pod.process.poll() is None:
            pod.process.kill()
            pod.process.wait(timeout=10)

    def stop_pod(self, name: str) -> None:
        """Stop a pod gracefully (SIGTERM)."""
        self._stop_pod_process(self.pods[name])

    def restart_pods(self) -> None:
        """Stop every pod, then start them all again (same ports)."""
        for pod in self.pods.values():
            self._stop_pod_process(pod)
        for pod in self.pods.values():
            self._spawn_pod(pod)
        for pod in self.pods.values():
            self._wait_pod(pod, self._startup_timeout)

    def heal(self) -> None:
        """Bring back whatever was stopped: the private Redis and every pod not running."""
        if self.redis is not None and not self.redis.running:
            self.redis.start()
        for pod in self.pods.values():
            if not pod.running:
                self.start_pod(pod.name)

    @staticmethod
    def _stop_pod_process(pod: Pod) -> None:
        if pod.process is not None:
            stop_process(pod.process, timeout=10)

    # --- nginx -------------------------------------------------------------------------------

    def _start_nginx(self, attempts: int = 3) -> None:
        binary = find_binary("nginx")
        if binary is None:
            raise ClusterError(f"nginx not found: {INSTALL_HINTS['nginx']}")
        runtime = self.state_dir / "nginx"
        runtime.mkdir(exist_ok=True)
        runtime.chmod(0o755)
        log_path = self.log_dir / "nginx.log"
        for attempt in range(attempts):
            self.nginx_port = free_port()
            config = runtime / "nginx.conf"
            config.write_text(
                render_local(
                    pod_ports=[pod.port for pod in self.pods.values()],
                    listen_port=self.nginx_port,
                    runtime_dir=runtime,
                ),
                encoding="utf-8",
            )
            args = [binary, "-p", str(runtime), "-c", str(config), "-g", "daemon off;"]
            if _nginx_knows_error_log_flag(binary):
                args[1:1] = ["-e", "stderr"]
            process = _spawn(args, log_path=log_path)
            self.nginx = process

            def ready(process: subprocess.Popen[bytes] = process) -> bool:
                if process.poll() is not None:
                    raise ClusterError(f"nginx exited on startup:\n{_tail(log_path)}")
                return http_ok(f"{self.url}/healthz")

            try:
                wait_until(ready, timeout=self._startup_timeout, interval=0.05, what="nginx")
                return
            except ClusterError:
                if attempt == attempts - 1 or "Address already in use" not in _tail(log_path):
                    raise

    def _stop_nginx(self) -> None:
        if self.nginx is not None:
            stop_process(self.nginx, timeout=10)

    # --- reporting ---------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Everything ``status`` and ``down`` need, as JSON-ready data."""
        return {
            "store": self.store,
            "url": self.url,
            "nginx": {"url": self.url, "pid": None if self.nginx is None else self.nginx.pid},
            "pods": {pod.name: {"url": pod.url, "pid": pod.pid} for pod in self.pods.values()},
            "redis": None
            if self.redis_url is None
            else {
                "url": self.redis_url,
                "pid": _redis_pid(self.redis.port) if self.redis is not None else None,
                "owned": self.redis is not None,
            },
            "postgres": {
                "url": self.database_url,
                "data_directory": self.postgres_data_dir,
                "owned": self.postgres is not None,
            },
            "logs": str(self.log_dir),
        }


def _nginx_knows_error_log_flag(binary: str) -> bool:
    """``nginx -e`` (error log before the config is read) exists since 1.19.5."""
    done = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    found = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", done.stderr + done.stdout)
    return found is not None and tuple(int(part) for part in found.groups()) >= (1, 19, 5)


def _redis_pid(port: int) -> int | None:
    try:
        info = redis_command(port, "INFO", "server").decode(errors="replace")
    except OSError:
        return None
    found = re.search(r"^process_id:(\d+)", info, re.MULTILINE)
    return int(found.group(1)) if found else None


# --- command line ------------------------------------------------------------------------------


def _state_file(state_dir: Path) -> Path:
    return state_dir / "state.json"


def _read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        return cast(dict[str, Any], json.loads(_state_file(state_dir).read_text()))
    except (OSError, ValueError):
        return None


def _alive(pid: int | None, marker: str = "") -> bool:
    """Is ``pid`` running, and (when ``marker`` is given) is it the program we think it is?"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        # A zombie (exited, not yet reaped by its parent) is not running.
        if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
            return False
    if not marker:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # no /proc: trust the pid
    return marker.encode() in cmdline


def _print_urls(state: Mapping[str, Any]) -> None:
    url = state["url"]
    print(f"payments demo is up (idempotency store: {state['store']})")
    print(f"  nginx     {url}   (round-robin over the pods)")
    for name, pod in state["pods"].items():
        print(f"  {name:<9} {pod['url']}")
    if state.get("redis"):
        print(f"  redis     {state['redis']['url']}")
    print(f"  postgres  {state['postgres']['url']}")
    print(f"  logs      {state['logs']}")
    print()
    print("Try it:")
    print(
        f"  curl -i -X POST {url}/payments -H 'Content-Type: application/json' "
        '-H \'Idempotency-Key: demo-1\' -d \'{"accountId": "acc-1", "amount": 25.5, '
        '"currency": "EUR", "merchantReference": "order-1"}\''
    )
    print(f"  curl -s '{url}/payments?merchantReference=order-1'")
    print("  (add -H 'X-Demo-Delay-Ms: 10000' to keep a payment in progress for 10 s)")


def _handle_termination(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _watch(cluster: Cluster) -> None:
    reported: set[str] = set()
    while True:
        time.sleep(1)
        for pod in cluster.pods.values():
            if not pod.running and pod.name not in reported:
                reported.add(pod.name)
                print(f"{pod.name} exited; see {pod.log_path}", file=sys.stderr)


def cmd_up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    previous = _read_state(state_dir)
    if previous is not None and _alive(previous.get("launcher_pid"), "examples.payments"):
        print(
            f"the demo is already running (launcher pid {previous['launcher_pid']}): "
            f"{previous['url']}; stop it with: python -m examples.payments.cluster down",
            file=sys.stderr,
        )
        return 1
    if args.detach:
        return _up_detached(args)
    cluster = Cluster(
        store=args.store,
        redis_url=os.environ.get("REDIS_URL") or None,
        database_url=os.environ.get("DATABASE_URL") or None,
        state_dir=state_dir,
        payments_lock_ttl_seconds=args.payments_lock_ttl,
        env={CRASH_HOOKS: "1"} if args.crash_hooks else None,
    )
    missing = cluster.missing_binaries()
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _handle_termination)
    signal.signal(signal.SIGHUP, _handle_termination)
    try:
        print("starting the payments demo ...", flush=True)
        cluster.start()
        state = {"launcher_pid": os.getpid(), "ready": True, **cluster.describe()}
        _state_file(state_dir).write_text(json.dumps(state, indent=2))
        _print_urls(state)
        print("\nCtrl-C (or: python -m examples.payments.cluster down) stops everything.")
        sys.stdout.flush()
        _watch(cluster)
    except KeyboardInterrupt:
        pass
    except ClusterError as exc:
        print(f"the demo did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping the payments demo ...", flush=True)
        try:
            cluster.close()
        finally:
            _state_file(state_dir).unlink(missing_ok=True)
        print("stopped.", flush=True)
    return 0


def _up_detached(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    _state_file(state_dir).unlink(missing_ok=True)
    log_path = state_dir / "launcher.log"
    log_path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "examples.payments.cluster",
        "up",
        "--store",
        args.store,
        "--state-dir",
        str(state_dir),
    ]
    if args.payments_lock_ttl is not None:
        command += ["--payments-lock-ttl", str(args.payments_lock_ttl)]
    if args.crash_hooks:
        command.append("--crash-hooks")
    launcher = _spawn(command, log_path=log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = _read_state(state_dir)
        if state is not None and state.get("launcher_pid") == launcher.pid and state["ready"]:
            _print_urls(state)
            print(f"\nrunning in the background (launcher pid {launcher.pid}, log {log_path});")
            print("stop it with: python -m examples.payments.cluster down")
            return 0
        if launcher.poll() is not None:
            print(f"the demo did not start:\n{_tail(log_path)}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"the demo did not start within 180 s:\n{_tail(log_path)}", file=sys.stderr)
    return 1


def cmd_down(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir
    state = _read_state(state_dir)
    if state is None:
        print("the demo is not running (no state file)")
        return 0
    launcher = state.get("launcher_pid")
    if _alive(launcher, "examples.payments"):
        assert launcher is not None
        os.kill(launcher, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(launcher, "examples.payments") and time.monotonic() < deadline:
            time.sleep(0.1)
    if _alive(launcher, "examples.payments"):
        assert launcher is not None
        os.kill(launcher, signal.SIGKILL)
    _stop_leftovers(state)
    _state_file(state_dir).unlink(missing_ok=True)
    print("stopped.")
    return 0


def _stop_leftovers(state: Mapping[str, Any]) -> None:
    """Stop what a launcher that died without cleaning up left behind (by recorded pid)."""
    targets: list[tuple[int | None, str]] = [(state["nginx"]["pid"], "nginx")]
    targets += [(pod["pid"], "uvicorn") for pod in state["pods"].values()]
    redis = state.get("redis")
    if redis and redis.get("owned"):
        targets.append((redis.get("pid"), "redis-server"))
    for pid, marker in targets:
        if pid and _alive(pid, marker):
            print(f"stopping leftover {marker} (pid {pid})")
            os.kill(pid, signal.SIGTERM)
    postgres = state.get("postgres") or {}
    data_directory = postgres.get("data_directory")
    if postgres.get("owned") and data_directory:
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(Path(data_directory, "postmaster.pid").read_text().split()[0])
            if _alive(pid, "postgres"):
                print(f"stopping leftover postgres (pid {pid})")
                os.kill(pid, signal.SIGINT)  # fast shutdown


def cmd_status(args: argparse.Namespace) -> int:
    state = _read_state(args.state_dir)
    if state is None or not _alive(state.get("launcher_pid"), "examples.payments"):
        print("the demo is not running", file=sys.stderr)
        return 1
    if args.url:
        print(state["url"])
        return 0
    healthy = True
    rows = [("nginx", state["url"], state["nginx"]["pid"], "nginx")]
    rows += [(name, pod["url"], pod["pid"], "uvicorn") for name, pod in state["pods"].items()]
    print(f"launcher pid {state['launcher_pid']}, idempotency store {state['store']}")
    for name, url, pid, marker in rows:
        up = _alive(pid, marker) and http_ok(f"{url}/healthz")
        healthy = healthy and up
        print(f"  {name:<8} {url:<28} pid {pid!s:<8} {'up' if up else 'DOWN'}")
    return 0 if healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.payments.cluster", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="where the state file and logs live (default: .demo/)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start everything (foreground until Ctrl-C)")
    up.add_argument("--store", choices=["redis", "postgres"], default="redis")
    up.add_argument("--detach", action="store_true", help="run in the background")
    up.add_argument(
        "--payments-lock-ttl", type=float, default=None, help="POST /payments lock TTL (s)"
    )
    up.add_argument(
        "--crash-hooks",
        action="store_true",
        help="let X-Demo-Crash: after-commit SIGKILL a pod (DEMO_CRASH_HOOKS=1)",
    )
    up.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS)
    commands.add_parser("down", help="stop what `up` started").add_argument(
        "--state-dir", type=Path, default=argparse.SUPPRESS
    )
    status = commands.add_parser("status", help="show what is running")
    status.add_argument("--url", action="store_true", help="print only the nginx URL")
    status.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.state_dir = Path(args.state_dir).resolve()
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "up": cmd_up,
        "down": cmd_down,
        "status": cmd_status,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
