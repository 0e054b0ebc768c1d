"""Files the documentation shows verbatim, so that the code it shows runs (and is type-checked)
in the suite: each ``<!-- example: PATH -->`` marker is followed by a Python block of PATH's
text."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SHOWN = re.compile(r"^<!-- example: (?P<path>\S+) -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def shown_files(text: str) -> dict[str, str]:
    """The files ``text`` shows, by path (relative to the repository), with the text shown."""
    return {match["path"]: match["code"] for match in _SHOWN.finditer(text)}


def drifted(page: Path, shown: dict[str, str]) -> list[str]:
    """The paths whose text ``shown`` (read from ``page``) is no longer the file's, each with
    what to do about it."""
    return [
        f"{page.relative_to(ROOT)} no longer shows {path} as it is: copy the file into the "
        "block after its marker"
        for path, code in shown.items()
        if code != (ROOT / path).read_text(encoding="utf-8")
    ]
