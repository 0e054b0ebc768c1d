"""The sdist and the wheel as users get them: what they hold, that the wheel installs, imports
and runs its command, and the workflow that publishes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

import starlette_idempotency

ROOT = Path(__file__).resolve().parent.parent
#: The operator's kit, package data (``starlette-idempotency monitoring --write DIR``).
MONITORING_KIT = ["grafana-dashboard.json", "prometheus-alerts.test.yml", "prometheus-alerts.yml"]
PUBLISH = ROOT / ".github" / "workflows" / "publish.yml"


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "-o", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def test_the_wheel_carries_the_license_types_and_resources_only(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    version = starlette_idempotency.__version__
    assert f"starlette_idempotency-{version}.dist-info/licenses/LICENSE" in names
    assert "starlette_idempotency/py.typed" in names
    resources = {Path(n).name for n in names if n.endswith((".lua", ".sql"))}
    assert {"acquire.lua", "finish.lua", "queries.sql", "schema.sql"} <= resources
    kit = sorted(
        n.rsplit("/", 1)[1] for n in names if n.startswith("starlette_idempotency/monitoring/")
    )
    assert kit == MONITORING_KIT
    assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/", "docs/"))]
    metadata = zipfile.ZipFile(wheel).read(f"starlette_idempotency-{version}.dist-info/METADATA")
    assert b"License-Expression: MIT" in metadata
    assert b"Project-URL: Changelog," in metadata


def test_the_sdist_carries_the_license_and_no_tests_or_results(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "SECURITY.md", "pyproject.toml"} <= names
    assert "src/starlette_idempotency/py.typed" in names
    # The operator's kit has one home, the package.
    assert {f"src/starlette_idempotency/monitoring/{name}" for name in MONITORING_KIT} <= names
    assert not (ROOT / "monitoring").exists()
    assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/", ".ci/"))]


def test_the_wheel_installs_and_every_public_name_imports(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
    # Nothing of this checkout on the fresh venv's path (a PYTHONPATH to src would shadow it).
    fresh = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        timeout=120,
    )
    # The dependencies come from this environment's site-packages, but not its editable
    # install of the project (a .pth inside it, which a plain path entry does not run).
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(fresh_site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = (
        "import starlette_idempotency as s\n"
        f"assert s.__file__.startswith({str(venv)!r}), s.__file__\n"
        "missing = [n for n in s.__all__ if getattr(s, n, None) is None]\n"
        "assert not missing, missing\n"
        # The readiness route a Kubernetes probe calls, served from the installed wheel.
        "from starlette.applications import Starlette\n"
        "from starlette.testclient import TestClient\n"
        "app = Starlette(routes=[s.readiness_route(s.MemoryStore())])\n"
        "with TestClient(app) as client:\n"
        "    ready = client.get('/ready')\n"
        "assert ready.status_code == 200, ready.text\n"
        "print(s.__version__)\n"
    )
    result = subprocess.run(
        [str(python), "-c", script],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=fresh,
    )
    assert result.stdout.strip() == starlette_idempotency.__version__

    command = str(venv / "bin" / "starlette-idempotency")
    helped = subprocess.run(
        [command, "--help"], capture_output=True, text=True, cwd=tmp_path, env=fresh
    )
    assert helped.returncode == 0, helped.stderr
    commands = {line.split()[0] for line in helped.stdout.splitlines() if line.startswith("    ")}
    assert {"migrate", "purge", "doctor", "monitoring"} <= commands
    kit = tmp_path / "kit"
    written = subprocess.run(
        [command, "monitoring", "--write", str(kit)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=fresh,
    )
    assert written.returncode == 0, written.stderr
    assert sorted(path.name for path in kit.iterdir()) == MONITORING_KIT
    assert b"IdempotencyStoreErrors" in (kit / "prometheus-alerts.yml").read_bytes()


def test_the_classifiers_list_the_pythons_ci_runs() -> None:
    """The main run's Python (requires-python's floor) and .ci/other-pythons' versions."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = {
        classifier.rsplit(" :: ", 1)[1]
        for classifier in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", classifier)
    }
    (floor,) = re.findall(r">=(3\.\d+)", project["requires-python"])
    (others,) = re.findall(r"PYTHONS:-([\d. ]+)\}", (ROOT / ".ci" / "other-pythons").read_text())
    assert listed == {floor, *others.split()}


def test_the_install_lines_name_this_version() -> None:
    version = starlette_idempotency.__version__
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        lines = [line for line in page.read_text().splitlines() if line.startswith("pip install")]
        assert lines, page
        assert all(f'=={version}"' in line for line in lines), (page, lines)


def publish_steps() -> dict[str, dict[str, str]]:
    workflow = yaml.safe_load(PUBLISH.read_text())
    jobs = workflow["jobs"]
    return {step["name"]: step for step in jobs["build"]["steps"] if "name" in step}


def test_the_publish_workflow_runs_on_tags_with_trusted_publishing() -> None:
    workflow = yaml.safe_load(PUBLISH.read_text())
    assert workflow[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads the key `on` as True
    assert workflow["permissions"] == {"contents": "read"}
    publish = workflow["jobs"]["publish"]
    assert publish["needs"] == "build"
    assert publish["environment"]["name"] == "pypi"
    assert publish["permissions"] == {"id-token": "write"}
    assert publish["steps"][-1]["uses"] == "pypa/gh-action-pypi-publish@release/v1"
    assert "with" not in publish["steps"][-1]  # no token: trusted publishing
    assert "python -m build -o dist ." in publish_steps()["Build"]["run"]


def test_the_publish_workflow_refuses_a_tag_that_is_not_the_version(
    dist: Path, tmp_path: Path
) -> None:
    """The workflow's check, run here on the built wheel: the tag and the changelog section."""
    check = publish_steps()["The tag is the package version, with its changelog section"]
    version = starlette_idempotency.__version__
    shutil.copytree(dist, tmp_path / "dist")

    def run_check(tag: str, changelog: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "CHANGELOG.md").write_text(changelog)
        return subprocess.run(
            ["bash", "-euo", "pipefail", "-c", check["run"]],
            cwd=tmp_path,
            env={**os.environ, "TAG": tag},
            capture_output=True,
            text=True,
            check=False,
        )

    dated = f"# Changelog\n\n## [{version}] - 2026-12-05\n\n### Added\n- it\n"
    passed = run_check(f"v{version}", dated)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert passed.stdout.startswith(f"releasing {version}: ")

    wrong_tag = run_check("v9.9.9", dated)
    assert wrong_tag.returncode == 1
    assert f"the tag v9.9.9 is not the package's version v{version}" in wrong_tag.stdout

    undated = run_check(f"v{version}", "# Changelog\n\n## [Unreleased]\n")
    assert undated.returncode == 1
    assert f"CHANGELOG.md has no dated section '## [{version}] - YYYY-MM-DD'" in undated.stdout
