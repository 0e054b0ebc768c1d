"""The documentation pages as Markdown renders them (tables that stay whole), and the home
page's claims about the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from starlette_idempotency.middleware import IdempotencyPolicy

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TABLE_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")


def table_starts(text: str) -> list[tuple[int, str]]:
    """The first line of each table outside code fences, and the line after it."""
    starts = []
    lines = text.splitlines()
    fenced = False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        before = lines[number - 1] if number else ""
        if not fenced and line.startswith("|") and not before.startswith("|"):
            following = lines[number + 1] if number + 1 < len(lines) else ""
            starts.append((number + 1, following))
    return starts


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_has_its_header_and_no_blank_line_cuts_one(page: Path) -> None:
    """A row after a blank line starts a table of its own, which renders as text."""
    for number, following in table_starts(page.read_text()):
        assert TABLE_SEPARATOR.match(following), f"{page.name}:{number}: a row outside a table"


def test_a_cut_table_is_found() -> None:
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert [bool(TABLE_SEPARATOR.match(following)) for _, following in table_starts(cut)] == [
        True,
        False,
    ]


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "index.md"])
def test_the_home_page_claims_the_default_fingerprint_and_names_validated_an_option(
    page: Path,
) -> None:
    assert IdempotencyPolicy().fingerprint == "raw"
    paragraphs = [" ".join(p.split()) for p in page.read_text().split("\n\n")]
    (claim,) = [p for p in paragraphs if "fingerprints of" in p]
    assert "fingerprints of the request as sent" in claim
    assert "as an option" in claim or 'fingerprint="validated"' in claim
