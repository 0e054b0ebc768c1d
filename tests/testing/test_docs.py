"""docs/how-to/testing.md shows the example's files verbatim, so the guide runs in the suite and
cannot drift from it: each ``<!-- example: PATH -->`` marker is followed by PATH's text."""

from __future__ import annotations

import importlib
import re

from tests.support.shown_files import ROOT, drifted, shown_files

GUIDE = ROOT / "docs" / "how-to" / "testing.md"


def test_the_guide_shows_the_example_files_verbatim() -> None:
    shown = shown_files(GUIDE.read_text(encoding="utf-8"))
    assert sorted(shown) == ["tests/testing/guide_app.py", "tests/testing/test_guide.py"]
    assert drifted(GUIDE, shown) == []


def test_a_changed_file_is_noticed() -> None:
    before, found, after = GUIDE.read_text(encoding="utf-8").rpartition("assert_ran_once(")
    assert found  # the last one is in the example's tests
    shown = shown_files(f"{before}assert_ran_twice({after}")
    assert drifted(GUIDE, shown) != []


def test_the_guide_loads_the_plugin_that_exists() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    (line,) = re.findall(r"^pytest_plugins = .*$", text, re.M)
    assert line == 'pytest_plugins = ["starlette_idempotency.testing.pytest_plugin"]'
    plugin = importlib.import_module("starlette_idempotency.testing.pytest_plugin")
    for fixture in re.findall(r"^\| `(\w+)` \| (?:session|test) \|", text, re.M):
        assert callable(getattr(plugin, fixture)), fixture
