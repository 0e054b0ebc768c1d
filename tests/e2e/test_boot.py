"""A misconfigured middleware stops the boot: the server exits non-zero with the message,
logged once through the library's logger, and never reports a healthy start. Under uvicorn's
default invocation (``--lifespan auto``), ``--lifespan on``, gunicorn with uvicorn workers, and
Starlette's ``TestClient``."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from starlette_idempotency import ConfigurationError
from starlette_idempotency.testing._processes import free_port
from tests.support.uvicorn import REPO_ROOT

pytestmark = pytest.mark.e2e

APP = "tests.e2e.apps.misconfigured:app"
EXPECTED = {
    "typo": (
        "unknown option for IdempotencyMiddleware: 'on_store_eror' (did you mean 'on_store_error'?)"
    ),
    "url": "store must be a store instance, not the string 'redis://localhost:6379/0'",
    "no store": "IdempotencyMiddleware needs a store: add store=MemoryStore()",
}
SERVERS = {
    "uvicorn": [sys.executable, "-m", "uvicorn", APP],
    "uvicorn --lifespan on": [sys.executable, "-m", "uvicorn", APP, "--lifespan", "on"],
    "gunicorn": [
        sys.executable,
        "-m",
        "gunicorn",
        "-k",
        "uvicorn_worker.UvicornWorker",
        "--workers",
        "2",
        APP,
    ],
}


def boot(command: list[str], mistake: str) -> subprocess.CompletedProcess[str]:
    port = str(free_port())
    bind = ["--bind", f"127.0.0.1:{port}"] if "gunicorn" in command else ["--port", port]
    return subprocess.run(
        command + bind,
        cwd=REPO_ROOT,
        env={**os.environ, "IDEM_TEST_MISCONFIGURED": mistake},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mistake", sorted(EXPECTED))
@pytest.mark.parametrize("server", sorted(SERVERS))
def test_the_server_exits_with_the_message(server: str, mistake: str) -> None:
    finished = boot(SERVERS[server], mistake)
    output = finished.stdout + finished.stderr
    assert finished.returncode != 0, output
    assert "Application startup complete" not in output
    assert "appears unsupported" not in output
    refusal = f"idempotency: the app cannot start: {EXPECTED[mistake]}"
    workers = 2 if server == "gunicorn" else 1  # each worker boots, and refuses, on its own
    assert 1 <= output.count(refusal) <= workers, output
    assert output.count(EXPECTED[mistake]) == output.count(refusal), output


@pytest.mark.parametrize("mistake", sorted(EXPECTED))
def test_a_test_client_raises_the_refusal(mistake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEM_TEST_MISCONFIGURED", mistake)
    module = importlib.reload(importlib.import_module(APP.partition(":")[0]))
    with (
        pytest.raises(ConfigurationError, match=re.escape(EXPECTED[mistake])),
        TestClient(module.app),
    ):
        pass


def test_a_well_configured_app_boots() -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", APP, "--port", str(port)],
        cwd=REPO_ROOT,
        env={**os.environ, "IDEM_TEST_MISCONFIGURED": "none"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "Application startup complete" in line:
                break
        else:
            pytest.fail("the server never started")
    finally:
        process.terminate()
        process.communicate(timeout=10)
