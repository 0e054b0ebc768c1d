"""Fingerprints of the validated command, for ``@idempotent(fingerprint="validated")``.

The body is validated with the FastAPI route's own body model, then fingerprinted field by
field: a field left out that has a static default equals the same field sent with that value,
``10`` equals ``10.0`` where the model says float, and a field filled by a ``default_factory``
(a fresh id, the current time) counts only when the client sent it, or no retry would match.

Finding the body model uses FastAPI's ``APIRoute.body_field`` (tested with FastAPI 0.115+).
"""

from __future__ import annotations

import decimal
import json
from typing import Any

import orjson
from pydantic import BaseModel, SecretBytes, SecretStr, TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

_SORT_KEYS = orjson.OPT_SORT_KEYS


def _command(value: Any, excluded: frozenset[str]) -> Any:
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        return {
            name: _command(getattr(value, name), excluded)
            for name, info in fields.items()
            if name.lower() not in excluded
            and not (info.alias and info.alias.lower() in excluded)
            and not (info.default_factory is not None and name not in value.model_fields_set)
        }
    if isinstance(value, dict):
        return {
            str(key): _command(item, excluded)
            for key, item in value.items()
            if str(key).lower() not in excluded
        }
    if isinstance(value, list | tuple):
        return [_command(item, excluded) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_command(item, excluded) for item in value), key=orjson.dumps)
    if isinstance(value, decimal.Decimal):
        return format(value.normalize(), "f")  # 10, 10.0 and 1E+1 are one amount
    if isinstance(value, SecretStr | SecretBytes):
        return to_jsonable_python(value.get_secret_value())
    return to_jsonable_python(value)


class CommandFingerprinter:
    """Validates a JSON body against a type and gives its canonical command bytes."""

    def __init__(self, body_type: Any, excluded: frozenset[str]) -> None:
        self._adapter: TypeAdapter[Any] = TypeAdapter(body_type)
        self._excluded = excluded

    def canonical(self, body: bytes) -> bytes | None:
        """The canonical command, or ``None`` when the body is not a valid command."""
        try:
            # The standard library's parser, as Starlette's Request.json() uses: whatever the
            # app accepts (NaN, integers past 64 bits) is accepted here too.
            value = self._adapter.validate_python(json.loads(body) if body else None)
        except (ValueError, ValidationError):
            return None
        return orjson.dumps(_command(value, self._excluded), option=_SORT_KEYS)


def fingerprinter_for_route(route: Any, excluded: frozenset[str]) -> CommandFingerprinter | None:
    """The fingerprinter for a FastAPI route's body, or ``None`` where there is no body model."""
    body_field = getattr(route, "body_field", None)
    if body_field is None:
        return None
    return CommandFingerprinter(body_field.field_info.annotation, excluded)
