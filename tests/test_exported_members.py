"""The public surface: each package's ``__all__`` is exactly what it defines (as httpx tests
its own), every name has one home, and the optional halves load only what they need."""

from __future__ import annotations
import __future__

import ast
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import starlette_idempotency
import starlette_idempotency.client
import starlette_idempotency.stores
import starlette_idempotency.testing

PACKAGES = [
    starlette_idempotency,
    starlette_idempotency.stores,
    starlette_idempotency.testing,
    starlette_idempotency.client,
]


def public_names(package: ModuleType) -> list[str]:
    """What ``package`` offers by name: everything not private, its submodules and
    ``from __future__ import annotations`` aside, and ``__version__``."""
    names = []
    for name in dir(package):
        value = getattr(package, name)
        if isinstance(value, ModuleType) or value is __future__.annotations:
            continue
        if not name.startswith("_") or name == "__version__":
            names.append(name)
    return sorted(names)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda package: package.__name__)
def test_all_is_exactly_what_the_package_offers(package: ModuleType) -> None:
    assert sorted(package.__all__) == public_names(package)


#: The names the root re-exports from ``stores``, their home: a store implementer's, which an
#: application needs too, to annotate the store it builds and to resolve a key by hand.
ROOT_FROM_STORES = {"IdempotencyStore", "StoredResponse"}
#: The names ``stores`` re-exports from ``errors`` (documented at the root, as every error):
#: what a store raises, so that a store module imports from ``stores`` alone.
STORES_FROM_ERRORS = {"StoreError", "StoreTimeoutError"}


def test_the_root_and_the_stores_share_only_the_declared_names() -> None:
    root, stores, testing = (set(p.__all__) for p in PACKAGES[:3])
    assert root & stores == ROOT_FROM_STORES | STORES_FROM_ERRORS
    for name in root & stores:
        assert getattr(starlette_idempotency, name) is getattr(starlette_idempotency.stores, name)
    assert (root | stores) & testing == set()


def test_each_shared_name_is_loaded_from_its_home() -> None:
    """The root loads what it re-exports from ``stores`` from there, and ``stores`` adds no
    error beyond the declared ones."""
    homes = starlette_idempotency._HOMES
    stores = starlette_idempotency.stores.__name__
    assert {name for name, home in homes.items() if home == stores} == ROOT_FROM_STORES
    errors = {
        name
        for name in starlette_idempotency.stores.__all__
        if getattr(starlette_idempotency.stores, name).__module__ == "starlette_idempotency.errors"
    }
    assert errors == STORES_FROM_ERRORS


def test_the_root_declares_each_name_for_type_checkers_where_it_loads_it_from() -> None:
    """The root loads its names on first use (``_HOMES``); what type checkers and IDEs read
    is the ``if TYPE_CHECKING`` imports, which must say the same."""
    source = Path(starlette_idempotency.__file__).read_text(encoding="utf-8")
    declared = {
        alias.name: node.module
        for block in ast.parse(source).body
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert declared == starlette_idempotency._HOMES
    assert set(declared) == set(starlette_idempotency.__all__) - {"__version__"}


def loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after ``statement``."""
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; {statement}; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.split())


def loaded_by_app(app: str, redis_url: str = "") -> set[str]:
    """The modules a FastAPI app of :mod:`bench.startup` loaded in a fresh interpreter, by the
    time it had started (the middleware's startup checks run then) and replayed a POST."""
    command = [sys.executable, "-m", "bench.startup", "--modules", app]
    done = subprocess.run(
        [*command, *(["--redis-url", redis_url] if redis_url else [])],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return set(done.stdout.split())


#: What the request path never needs, which an app must not load by starting and answering:
#: the optional halves (the command line, the client, the test helpers, the integrations, the
#: other stores) and their libraries.
OFF_THE_REQUEST_PATH = {
    "starlette_idempotency.cli",
    "starlette_idempotency._cli_keys",
    "starlette_idempotency.client",
    "starlette_idempotency.testing",
    "starlette_idempotency.prometheus",
    "starlette_idempotency.readiness",
    "starlette_idempotency._transaction",
    "starlette_idempotency.stores.postgres",
    "starlette_idempotency.stores.redis._glide",
    "httpx",
    "sqlalchemy",
    "asyncpg",
    "prometheus_client",
    "glide",
}


def test_the_root_loads_no_module_of_its_names() -> None:
    """``import starlette_idempotency`` costs two small modules: every name loads on first use,
    so an app (or the client, or the command line) loads only what it uses."""
    modules = loaded_by("import starlette_idempotency") - loaded_by("pass")
    ours = {m for m in modules if m.startswith("starlette_idempotency")}
    assert ours == {"starlette_idempotency", "starlette_idempotency._deprecation"}
    assert {m.split(".")[0] for m in modules - ours} <= set(sys.stdlib_module_names)


def test_every_name_of_all_resolves_in_a_fresh_interpreter() -> None:
    loaded_by(
        "import starlette_idempotency as s; missing = set(s.__all__) - set(dir(s)); "
        "assert not missing, missing; [getattr(s, name) for name in s.__all__]"
    )


def test_an_app_on_memory_loads_only_the_request_path() -> None:
    modules = loaded_by_app("memory")
    assert OFF_THE_REQUEST_PATH & modules == set()
    assert "starlette_idempotency.stores.redis" not in modules
    assert "redis" not in modules
    assert "starlette_idempotency._store_check" in modules  # the startup checks ran
    assert "starlette_idempotency._request" in modules  # and a guarded request


@pytest.mark.redis
def test_an_app_on_redis_loads_only_the_request_path(redis_url: str) -> None:
    modules = loaded_by_app("redis", redis_url)
    assert OFF_THE_REQUEST_PATH & modules == set()
    assert {"starlette_idempotency.stores.redis._redis_py", "redis"} <= modules


def test_the_client_loads_httpx_and_never_starlette() -> None:
    modules = loaded_by("import starlette_idempotency.client")
    assert "httpx" in modules
    assert {m for m in modules if m.split(".")[0] in ("starlette", "fastapi", "redis")} == set()
    ours = {m for m in modules if m.startswith("starlette_idempotency")}
    assert ours == {
        "starlette_idempotency",
        "starlette_idempotency._deprecation",
        "starlette_idempotency._types",
        "starlette_idempotency.client",
        "starlette_idempotency.client._retry_policy",
        "starlette_idempotency.client._transports",
        "starlette_idempotency.errors",
    }


def test_a_root_name_loads_on_first_use_and_stays() -> None:
    modules = loaded_by(
        "import starlette_idempotency as s; assert 'MemoryStore' not in vars(s); "
        "s.MemoryStore; assert 'MemoryStore' in vars(s)"
    )
    assert "starlette_idempotency.stores.memory" in modules
    assert "starlette" not in loaded_by("import starlette_idempotency")


def test_a_public_submodule_is_an_attribute_of_the_root() -> None:
    assert starlette_idempotency.errors.StoreError is starlette_idempotency.StoreError
    assert not hasattr(starlette_idempotency, "no_such_name")
    assert not hasattr(starlette_idempotency, "_no_such_module")


def test_install_openapi_is_the_roots_and_loads_no_fastapi() -> None:
    """The package never imports FastAPI itself: an app that is one has imported it."""
    modules = loaded_by("from starlette_idempotency import install_openapi")
    assert "starlette_idempotency._openapi.install" in modules
    assert "fastapi" not in modules
