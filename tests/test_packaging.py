"""The sdist and the wheel as users get them: what they hold, and that the wheel imports."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import starlette_idempotency

ROOT = Path(__file__).resolve().parent.parent


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
    assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/", "docs/"))]
    metadata = zipfile.ZipFile(wheel).read(f"starlette_idempotency-{version}.dist-info/METADATA")
    assert b"License-Expression: MIT" in metadata
    assert b"Project-URL: Changelog," in metadata


def test_the_sdist_carries_the_license_and_no_tests_or_results(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= names
    assert "src/starlette_idempotency/py.typed" in names
    # The operator's kit: the Grafana dashboard, the alerting rules and their promtool tests.
    monitoring = {path.relative_to(ROOT).as_posix() for path in (ROOT / "monitoring").iterdir()}
    assert monitoring == {
        "monitoring/grafana-dashboard.json",
        "monitoring/prometheus-alerts.yml",
        "monitoring/prometheus-alerts.test.yml",
    }
    assert monitoring <= names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "examples/", ".ci/"))]


def test_the_wheel_installs_and_every_public_name_imports(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    venv = tmp_path / "venv"
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
        "print(s.__version__)\n"
    )
    result = subprocess.run(
        [str(python), "-c", script], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    assert result.stdout.strip() == starlette_idempotency.__version__


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
