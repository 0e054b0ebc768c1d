"""The schema exported before the app starts (``install_openapi(app)``, then
``json.dumps(app.openapi())``, as client generators and CI contract checks do) is the schema
``/openapi.json`` serves once it runs; no class of FastAPI's is patched for it."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.applications import Starlette

from starlette_idempotency import (
    ConfigurationError,
    IdempotencyMiddleware,
    MemoryStore,
    idempotent,
    install_openapi,
)
from starlette_idempotency._responses import IdempotencyProblem
from tests.core.test_openapi import (
    Schema,
    client,
    key_parameters,
    lifespan_of,
    payments_app,
    served_schema,
)


def envelope(problem: IdempotencyProblem) -> dict[str, Any]:
    return {"ok": False, "reason": problem.code}


CONFIGURATIONS = {
    "decorated": {},
    "protect_all": {"protect_all": True},
    "header_name": {"header_name": "X-Request-Key", "max_key_length": 64},
    "problem": {"error_format": "problem", "problem_type": "https://errors.example/idem"},
    "stripe": {"error_format": "stripe"},
    "callable": {"error_format": envelope},
    "replay_header": {"replay_header_name": "Idempotent-Replayed"},
    "reject_and_hold": {"replay": "reject", "on_recovery": "hold", "ttl_hours": 2},
}


FASTAPIS_OWN = FastAPI.openapi


def exported(app: FastAPI) -> Schema:
    """What a script exporting the schema writes: ``json.dumps(app.openapi())``."""
    schema: Schema = json.loads(json.dumps(app.openapi()))
    return schema


def installed(app: FastAPI) -> FastAPI:
    install_openapi(app)
    return app


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
async def test_the_schema_exported_before_startup_is_the_one_served(options: Any) -> None:
    app = installed(payments_app(**options))
    before = exported(app)
    assert FastAPI.openapi is FASTAPIS_OWN  # the app's own openapi, not FastAPI's class
    assert "409" in before["paths"]["/payments"]["post"]["responses"]
    async with lifespan_of(app):
        served = await served_schema(app)
    assert before == served
    assert exported(installed(payments_app(**options))) == served  # and so from a fresh app


async def test_without_install_openapi_an_early_export_is_fastapis_and_startup_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = payments_app()
    plain = get_openapi(title=app.title, version=app.version, routes=app.routes)
    assert exported(app) == plain
    with caplog.at_level(logging.WARNING, logger="starlette_idempotency"):
        async with lifespan_of(app):
            served = await served_schema(app)
    assert "call starlette_idempotency.install_openapi(app)" in caplog.text
    assert "409" in served["paths"]["/payments"]["post"]["responses"]


def test_install_openapi_refuses_what_it_cannot_document() -> None:
    with pytest.raises(ConfigurationError, match="a Starlette app has no OpenAPI schema"):
        install_openapi(Starlette())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"call it after app\.add_middleware"):
        install_openapi(FastAPI())


async def test_install_openapi_after_startup_changes_nothing() -> None:
    app = payments_app()
    async with lifespan_of(app):
        served = await served_schema(app)
        install_openapi(app)
        assert exported(app) == served


async def test_the_started_middleware_documents_once() -> None:
    app = installed(payments_app())
    exported(app)
    async with lifespan_of(app):
        schema = await served_schema(app)
        assert app.openapi() is app.openapi()
    operation = schema["paths"]["/payments"]["post"]
    assert len(key_parameters(operation)) == 1
    assert operation["responses"]["409"]["description"].count("idempotency middleware") == 1
    assert operation["responses"]["422"]["content"]["application/json"]["schema"] == {
        "anyOf": [
            {"$ref": "#/components/schemas/HTTPValidationError"},
            {"$ref": "#/components/schemas/IdempotencyError"},
        ]
    }


async def test_openapi_before_and_after_the_first_request_without_a_lifespan() -> None:
    app = installed(payments_app())
    before = exported(app)
    async with client(app) as http:
        assert (await http.get("/payments")).status_code == 200
    assert exported(app) == before


async def test_middleware_added_after_a_first_export_is_documented() -> None:
    app = FastAPI()

    @app.post("/notes")
    async def note() -> dict[str, str]:
        return {}

    assert not key_parameters(exported(app)["paths"]["/notes"]["post"])
    app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), protect_all=True)
    install_openapi(app)
    assert key_parameters(exported(app)["paths"]["/notes"]["post"])


def test_apps_without_the_middleware_are_fastapis_own() -> None:
    app = FastAPI()

    @app.post("/payments")
    @idempotent()
    async def pay() -> dict[str, str]:
        return {}

    plain = get_openapi(title=app.title, version=app.version, routes=app.routes)
    assert app.openapi() == plain


def test_a_user_override_that_calls_fastapis_openapi_is_completed_before_startup() -> None:
    app = payments_app()

    def custom_openapi() -> Schema:
        if app.openapi_schema:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        schema["info"]["x-logo"] = {"url": "https://example.com/logo.png"}
        return schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    install_openapi(app)  # after the override, which it composes
    schema = exported(app)
    assert schema["info"]["x-logo"] == {"url": "https://example.com/logo.png"}
    assert len(key_parameters(schema["paths"]["/payments"]["post"])) == 1


def test_a_misconfigured_middleware_refuses_the_export() -> None:
    app = payments_app(on_store_eror="fail_open")  # the typo the startup would refuse too
    with pytest.raises(ConfigurationError, match="did you mean 'on_store_error'"):
        install_openapi(app)


APP_MODULE = """
from __future__ import annotations

{imports}
from pydantic import BaseModel


class Payment(BaseModel):
    amount: int


app = FastAPI(title="exported")


@app.post("/payments", status_code=201)
@idempotent(ttl_hours=48)
async def pay(body: Payment) -> Payment:
    return body


@app.post("/notes")
async def note(body: Payment) -> Payment:
    return body


app.add_middleware(IdempotencyMiddleware, store=MemoryStore(), error_format="problem")
install_openapi(app)
"""
FASTAPI_FIRST = """
from fastapi import FastAPI
from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent, install_openapi
"""
PACKAGE_FIRST = """
from starlette_idempotency import IdempotencyMiddleware, MemoryStore, idempotent, install_openapi
from fastapi import FastAPI
"""


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_in_a_fresh_process(folder: Path) -> Schema:
    """``json.dumps(app.openapi())`` of ``payments_api.app`` in a new Python process."""
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        from payments_api import app
        assert "fastapi" in sys.modules and app.middleware_stack is None
        print(json.dumps(app.openapi()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    schema: Schema = json.loads(done.stdout)
    return schema


@pytest.mark.parametrize("imports", [FASTAPI_FIRST, PACKAGE_FIRST], ids=["fastapi", "package"])
async def test_a_fresh_process_that_only_exports_gets_the_served_schema(
    tmp_path: Path, imports: str
) -> None:
    module = tmp_path / "payments_api.py"
    module.write_text(APP_MODULE.format(imports=imports.strip()))
    export = export_in_a_fresh_process(tmp_path)
    app = load(module).app
    async with lifespan_of(app):
        served = await served_schema(app)
    assert export == served
    assert key_parameters(export["paths"]["/payments"]["post"])
    assert "409" in export["paths"]["/payments"]["post"]["responses"]
