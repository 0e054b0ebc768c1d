"""Renders ``nginx.conf.template``: for a local run (the launcher) and for docker compose.

Both configurations come from :func:`render_config`, so they cannot drift apart; the compose
copy is committed as ``nginx.compose.conf`` and a test checks it is up to date. Regenerate it
with ``python -m examples.payments.nginx``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "nginx.conf.template"
COMPOSE_CONFIG = HERE / "nginx.compose.conf"

# The pods as docker compose names them, and the port they listen on inside the network.
COMPOSE_PODS = ("pod-a", "pod-b")
COMPOSE_POD_PORT = 8000
COMPOSE_NGINX_PORT = 80

_PLACEHOLDER = re.compile(r"\{\{ *(\w+) *\}\}")


def render_config(
    *,
    upstreams: Sequence[str],
    listen: str,
    pid_file: str,
    temp_dir: str,
    access_log: str = "off",
) -> str:
    """The nginx.conf text: ``upstreams`` are ``host:port`` of the pods."""
    if not upstreams:
        raise ValueError("at least one upstream is needed")
    values = {
        "upstream_servers": "\n".join(
            f"        server {upstream} max_fails=1 fail_timeout=5s;" for upstream in upstreams
        ),
        "listen": listen,
        "pid_file": pid_file,
        "temp_dir": temp_dir,
        "access_log": access_log,
    }

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"nginx template placeholder {name!r} has no value")
        return values[name]

    return _PLACEHOLDER.sub(substitute, TEMPLATE.read_text(encoding="utf-8"))


def render_local(*, pod_ports: Sequence[int], listen_port: int, runtime_dir: Path) -> str:
    """The launcher's configuration: loopback only, every path inside ``runtime_dir``."""
    return render_config(
        upstreams=[f"127.0.0.1:{port}" for port in pod_ports],
        listen=f"127.0.0.1:{listen_port}",
        pid_file=str(runtime_dir / "nginx.pid"),
        temp_dir=str(runtime_dir),
        access_log=f"{runtime_dir / 'access.log'} upstreams",
    )


def render_compose() -> str:
    """The docker compose configuration (``nginx.compose.conf``)."""
    return render_config(
        upstreams=[f"{pod}:{COMPOSE_POD_PORT}" for pod in COMPOSE_PODS],
        listen=str(COMPOSE_NGINX_PORT),
        pid_file="/tmp/nginx.pid",
        temp_dir="/tmp",
        access_log="/dev/stdout upstreams",
    )


def upstream_servers(config: str) -> list[str]:
    """The ``server`` entries of the ``payments_pods`` upstream in a rendered config."""
    block = re.search(r"upstream payments_pods \{(.*?)\}", config, re.DOTALL)
    if block is None:
        return []
    return re.findall(r"^\s*server\s+(\S+?)(?:\s[^;]*)?;", block.group(1), re.MULTILINE)


if __name__ == "__main__":
    COMPOSE_CONFIG.write_text(render_compose(), encoding="utf-8")
    print(f"wrote {COMPOSE_CONFIG}")
