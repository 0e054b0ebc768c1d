""".ci/system-deps, which the Taskfile and CI run before the tests: it asks apt for what is
missing and needed only, starts and enables nothing, and goes on without root when the
services are given by URL. Run with stand-ins for apt-get, apt-cache, systemctl and id on a
PATH of its own, and the programs it looks for as empty files where it looks."""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from starlette_idempotency.testing import _postgres_server as postgres_server
from starlette_idempotency.testing import _processes as processes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "system-deps"

#: Records its arguments; `install` also records how the policy-rc.d file answers then.
APT_GET = """#!/bin/bash
echo "apt-get $*" >> "$LOG"
if [ "$1" = install ]; then
  policy="$SYSTEM_DEPS_POLICY_RC_D"
  if [ -x "$policy" ]; then "$policy"; echo "policy-rc.d $?" >> "$LOG"
  else echo "policy-rc.d none" >> "$LOG"; fi
fi
"""
APT_CACHE = '#!/bin/bash\n[ "$2" = nginx-light ]\n'
SYSTEMCTL = '#!/bin/bash\necho "systemctl $*" >> "$LOG"\n'


@dataclass
class Machine:
    root: Path
    uid: int = 0

    def __post_init__(self) -> None:
        self.bin = self.root / "bin"
        self.sbin = self.root / "sbin"
        self.postgres_lib = self.root / "postgresql"
        self.policy = self.root / "policy-rc.d"
        self.log = self.root / "log"
        for directory in (self.bin, self.sbin, self.postgres_lib):
            directory.mkdir()
        for tool in ("bash", "ls", "chmod", "rm"):
            found = shutil.which(tool)
            assert found is not None
            (self.bin / tool).symlink_to(found)
        self.program("apt-get", APT_GET)
        self.program("apt-cache", APT_CACHE)
        self.program("systemctl", SYSTEMCTL)

    def program(self, name: str, text: str = "", directory: Path | None = None) -> None:
        path = (directory or self.bin) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text or "#!/bin/bash\n")
        path.chmod(0o755)

    def run(self, what: str, **env: str) -> subprocess.CompletedProcess[str]:
        self.program("id", f"#!/bin/bash\necho {self.uid}\n")
        environment = {
            "PATH": str(self.bin),
            "LOG": str(self.log),
            "SYSTEM_DEPS_SBIN_DIRS": str(self.sbin),
            "SYSTEM_DEPS_POSTGRES_LIB": str(self.postgres_lib),
            "SYSTEM_DEPS_POLICY_RC_D": str(self.policy),
            **env,
        }
        return subprocess.run(
            [shutil.which("bash") or "bash", str(SCRIPT), what],
            env=environment,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    @property
    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


URLS = {"REDIS_URL": "redis://cache:6379/0", "DATABASE_URL": "postgresql://db/app"}


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def test_nothing_is_asked_of_apt_when_everything_is_there(machine: Machine) -> None:
    machine.program("nginx", directory=machine.sbin)  # Debian's nginx is not on PATH
    machine.program("redis-server")
    machine.program("initdb", directory=machine.postgres_lib / "15" / "bin")
    machine.program("prometheus")
    machine.program("promtool")
    ran = machine.run("test")
    assert ran.returncode == 0, ran.stderr
    assert machine.calls == []


def test_as_root_only_the_missing_are_installed_and_nothing_is_enabled(machine: Machine) -> None:
    machine.program("redis-server", directory=machine.sbin)
    machine.program("initdb")  # on PATH, as Homebrew's or a non-Debian layout has it
    ran = machine.run("test")
    assert ran.returncode == 0, ran.stderr
    assert machine.calls == [
        "apt-get update -qq",
        "apt-get install -y -qq --no-install-recommends nginx-light prometheus",
        "policy-rc.d 101",  # no service started during the install
        "systemctl disable --now nginx",
        "systemctl disable --now prometheus",
    ]
    assert not machine.policy.exists()  # removed again


def test_a_policy_rc_d_of_the_machines_own_is_left_alone(machine: Machine) -> None:
    machine.program("nginx")
    machine.program("redis-server")
    machine.program("initdb")
    machine.program(machine.policy.name, "#!/bin/sh\nexit 0\n", directory=machine.root)
    assert machine.run("test").returncode == 0
    assert "policy-rc.d 0" in machine.calls
    assert machine.policy.read_text() == "#!/bin/sh\nexit 0\n"


def test_the_demo_uses_the_servers_given_by_url(machine: Machine) -> None:
    ran = machine.run("demo", **URLS)
    assert ran.returncode == 0, ran.stderr
    assert "apt-get install -y -qq --no-install-recommends nginx-light" in machine.calls

    machine.log.unlink()
    machine.program("nginx")
    assert machine.run("demo", REDIS_URL=URLS["REDIS_URL"]).returncode == 0
    assert "apt-get install -y -qq --no-install-recommends postgresql" in machine.calls


def test_without_root_it_says_what_to_install_and_goes_on_with_urls(machine: Machine) -> None:
    machine.uid = 1000
    refused = machine.run("test")
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        "missing: nginx redis-server postgresql prometheus -- install them: sudo apt-get "
        "install --no-install-recommends nginx redis-server postgresql prometheus"
    ]

    with_urls = machine.run("test", **URLS)
    assert with_urls.returncode == 0
    assert "going on with REDIS_URL and DATABASE_URL" in with_urls.stderr
    assert machine.calls == []  # apt is never asked without root


def test_it_looks_where_the_tests_look() -> None:
    """The defaults the script searches are the lookups of the tests' server launchers."""
    script = SCRIPT.read_text()
    (sbin,) = re.findall(r"SYSTEM_DEPS_SBIN_DIRS:-([^}]*)\}", script)
    assert tuple(sbin.split()) == processes.SBIN_DIRS
    (postgres_lib,) = re.findall(r"SYSTEM_DEPS_POSTGRES_LIB:-([^}]*)\}", script)
    assert f'"{postgres_lib}/*/bin"' in inspect.getsource(postgres_server.postgres_bin_dirs)
    assert os.access(SCRIPT, os.X_OK)
