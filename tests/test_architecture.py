"""The package's structure, as docs/explanation/architecture.md draws it: no import cycle
(not even under TYPE_CHECKING), nothing below the middleware importing it, and the route
options declared once."""

from __future__ import annotations

import ast
import types
import typing
from collections import abc
from collections.abc import Iterator
from pathlib import Path

from starlette_idempotency._options import ROUTE_OPTIONS, IdempotencyPolicy, RouteOptions

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "starlette_idempotency"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports(path: Path) -> Iterator[str]:
    """Every module of the package that ``path`` imports, wherever the import statement is."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("starlette_idempotency"):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    yield submodule if module_path(submodule) else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("starlette_idempotency"):
                    yield alias.name


def module_path(name: str) -> Path | None:
    relative = Path(*name.split("."))
    for candidate in (relative.with_suffix(".py"), relative / "__init__.py"):
        path = PACKAGE.parent / candidate
        if path.exists():
            return path
    return None


def import_graph() -> dict[str, set[str]]:
    return {
        module_name(path): set(package_imports(path)) - {module_name(path)}
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_the_package_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_nothing_below_the_middleware_imports_it() -> None:
    importers = {
        module
        for module, imports in import_graph().items()
        if "starlette_idempotency.middleware" in imports
    }
    # The package root re-exports it; the command line and the testing helpers sit above it.
    above = {"starlette_idempotency", "starlette_idempotency.cli"}
    assert importers - above - {m for m in importers if ".testing" in m} == set()


def _option_type(annotation: object) -> object:
    """Sequences compare by their items: the policy keeps a tuple of what the keywords accept
    as any sequence (optional ones too)."""
    if typing.get_origin(annotation) in (tuple, abc.Sequence):
        return ("a sequence of", typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType):
        return frozenset(_option_type(member) for member in typing.get_args(annotation))
    return annotation


def test_the_route_options_keywords_match_the_policy() -> None:
    keywords = typing.get_type_hints(RouteOptions)
    policy = typing.get_type_hints(IdempotencyPolicy)
    assert set(keywords) == ROUTE_OPTIONS
    assert {name: _option_type(policy[name]) for name in ROUTE_OPTIONS} == {
        name: _option_type(annotation) for name, annotation in keywords.items()
    }
