"""A Griffe extension for the API reference: the package's docstrings use Sphinx's inline roles
(``:class:`~starlette_idempotency.RedisStore```) and reST literal blocks (a paragraph ending in
``::``), which Markdown would print as they are.

Each role becomes an optional cross-reference: a link when the target is on the site, plain
code when it is not (a private helper, say), so the build never fails on one. Names are
resolved in the docstring's own scope, as Sphinx resolves them. A paragraph's closing ``::``
becomes ``:`` (the indented block after it is already a Markdown code block).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?P<role>class|meth|func|mod|attr|exc|data|obj):`(?P<target>[^`]+)`")
_CALLABLE_ROLES = frozenset({"meth", "func"})


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as seen from ``obj``; the target itself when unknown."""
    if target.startswith("starlette_idempotency"):
        return target
    first, _, rest = target.lstrip(".").partition(".")
    scopes = [obj] if obj.is_module or obj.is_class else []
    if obj.parent is not None:
        scopes.append(obj.parent)
    for scope in scopes:
        try:
            path = scope.resolve(first)
        except griffe.NameResolutionError:
            continue
        return f"{path}.{rest}" if rest else path
    return target


def _link(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"]
    shown = target.lstrip("~")
    if target.startswith("~"):
        shown = shown.rsplit(".", 1)[-1]
    if match["role"] in _CALLABLE_ROLES:
        shown += "()"
    identifier = _resolve(obj, target.lstrip("~"))
    return f'<autoref identifier="{identifier}" optional>`{shown}`</autoref>'


def _literal_blocks(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.strip() == "::":
            continue
        lines.append(line[:-1] if line.endswith("::") else line)
    return "\n".join(lines)


class SphinxRoles(griffe.Extension):
    """Rewrites each docstring once the package is loaded, so that names resolve."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _ROLE.sub(lambda match: _link(obj, match), obj.docstring.value)
        obj.docstring.value = _literal_blocks(text)
