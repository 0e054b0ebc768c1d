"""The launcher's command line: ``up --detach``, ``status`` and ``down`` leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from examples.payments.cluster import REPO_ROOT, _alive, http_ok

pytestmark = pytest.mark.e2e


def launcher(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "examples.payments.cluster", "--state-dir", str(state_dir), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_up_detach_status_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "demo"
    try:
        up = launcher(state_dir, "up", "--detach", "--store", "postgres")
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((state_dir / "state.json").read_text())
        assert state["url"] in up.stdout
        assert http_ok(f"{state['url']}/healthz")
        status = launcher(state_dir, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count(" up") == 3
        url = launcher(state_dir, "status", "--url")
        assert url.stdout.strip() == state["url"]
        again = launcher(state_dir, "up", "--detach")
        assert again.returncode == 1
        assert "already running" in again.stderr
    finally:
        down = launcher(state_dir, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (state_dir / "state.json").exists()
    pids = [state["launcher_pid"], state["nginx"]["pid"]]
    pids += [pod["pid"] for pod in state["pods"].values()]
    assert not any(_alive(pid) for pid in pids)
    assert not http_ok(f"{state['url']}/healthz")
    assert launcher(state_dir, "status").returncode == 1
