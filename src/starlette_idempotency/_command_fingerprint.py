"""Fingerprints of the validated command, for ``@idempotent(fingerprint="validated")``.

The body is validated with the FastAPI route's own body model, then fingerprinted field by
field: a field left out that has a static default equals the same field sent with that value,
``10`` equals ``10.0`` where the model says float, and a field filled by a ``default_factory``
(a fresh id, the current time) counts only when the client sent it, or no retry would match.
The extra fields a model with ``extra="allow"`` keeps count too, by the names they came with;
one sent under a declared field's name (only its alias is read) sends the body to the raw form.
The command is written by the standard library's encoder, exact for what its parser reads:
integers of any size, ``NaN``, ``Infinity`` and ``-Infinity`` apart, lone surrogates escaped.

Only a body FastAPI reads as JSON is a command: ``application/json`` or ``application/*+json``,
or no content type on a route that allows it (``strict_content_type=False``, or FastAPI before
that option). Any other body, and a command that cannot be written exactly (nested deeper
than 254 levels), takes the raw fingerprint, as does every request to a route whose body is a
form. A body the parser or the model rejects is no command: the app answers its own 422.

Finding the body model uses FastAPI's ``APIRoute.body_field``, or for a route of an included
router the effective route's, which FastAPI validates with (see :mod:`._routing`).
"""

from __future__ import annotations

import decimal
import json
from typing import Any

from pydantic import BaseModel, SecretBytes, SecretStr, TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from starlette_idempotency._fingerprint import (
    is_json_content_type,
    json_depth_within_limit,
    raw_body_form,
)
from starlette_idempotency._types import Body


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


def _command(value: Any, excluded: frozenset[str]) -> Any:
    if isinstance(value, BaseModel):
        fields = type(value).model_fields
        command = {
            name: _command(getattr(value, name), excluded)
            for name, info in fields.items()
            if name.lower() not in excluded
            and not (info.alias and info.alias.lower() in excluded)
            and not (info.default_factory is not None and name not in value.model_fields_set)
        }
        extra = value.model_extra  # what extra="allow" keeps: the app reads it as well
        if extra:
            if not fields.keys().isdisjoint(extra):
                # Sent under a field's name where only the alias is read: beside the field,
                # it would stand for the field itself. The raw form tells the two apart.
                raise ValueError("an extra field is named like a declared one")
            for name, item in extra.items():
                if name.lower() not in excluded:
                    command[name] = _command(item, excluded)
        return command
    if isinstance(value, dict):
        return {
            str(key): _command(item, excluded)
            for key, item in value.items()
            if str(key).lower() not in excluded
        }
    if isinstance(value, list | tuple):
        return [_command(item, excluded) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_command(item, excluded) for item in value), key=_encode)
    if isinstance(value, decimal.Decimal):
        return format(value.normalize(), "f")  # 10, 10.0 and 1E+1 are one amount
    if isinstance(value, SecretStr | SecretBytes):
        return to_jsonable_python(value.get_secret_value())
    return to_jsonable_python(value)


#: ``absent`` for a body the route requires: a request without one is no command.
REQUIRED: Any = object()


class CommandFingerprinter:
    """Validates a JSON body against a type and gives its canonical command bytes.

    ``json_without_content_type`` says whether the route reads a body sent without a content
    type as JSON, as FastAPI does unless its ``strict_content_type`` is on. ``absent`` is the
    value a request without a body stands for (the body parameter's default, as FastAPI fills
    it in), or :data:`REQUIRED`.
    """

    def __init__(
        self,
        body_type: Any,
        excluded: frozenset[str],
        *,
        json_without_content_type: bool = True,
        absent: Any = None,
    ) -> None:
        self._adapter: TypeAdapter[Any] = TypeAdapter(body_type)
        self._excluded = excluded
        self._json_without_content_type = json_without_content_type
        self._absent = absent

    def canonical(self, body: Body, content_type: str) -> tuple[str, Body] | None:
        """The body's canonical form as ``(kind, bytes)``: the ``command`` when the body is
        one, the raw form when FastAPI would not read it as JSON or the command cannot be
        written exactly, ``None`` when the body is not a valid command."""
        reads_json = (
            is_json_content_type(content_type) if content_type else self._json_without_content_type
        )
        if not body:  # FastAPI reads no body at all, and takes the parameter's default
            if self._absent is REQUIRED:
                return None
            value = self._absent
        elif not reads_json:
            return self._raw(body, content_type)
        else:
            try:
                # The standard library's parser, as Starlette's Request.json() uses: whatever
                # the app accepts (NaN, integers past 64 bits) is accepted here too.
                data = json.loads(body)
            except RecursionError:
                return self._raw(body, content_type)
            except ValueError:
                return None
            if not json_depth_within_limit(data):
                return self._raw(body, content_type)
            try:
                value = self._adapter.validate_python(data)
            except ValidationError:
                return None
        try:
            return "command", _encode(_command(value, self._excluded)).encode("ascii")
        except (RecursionError, ValueError, ArithmeticError):
            return self._raw(body, content_type)

    def _raw(self, body: Body, content_type: str) -> tuple[str, Body]:
        return raw_body_form(body, content_type=content_type, excluded=self._excluded)


def _is_form(body_field: Any) -> bool:
    from fastapi import params

    return isinstance(body_field.field_info, params.Form)


def fingerprinter_for_route(route: Any, excluded: frozenset[str]) -> CommandFingerprinter | None:
    """The fingerprinter for a FastAPI route's JSON body, or ``None`` where there is no body
    model or the body is a form (read by FastAPI's form parser: the raw fingerprint applies)."""
    body_field = getattr(route, "body_field", None)
    if body_field is None or _is_form(body_field):
        return None
    # A DefaultPlaceholder where neither the route nor a router above it sets it.
    strict = getattr(route, "strict_content_type", False)
    field_info = body_field.field_info
    if field_info.is_required():
        absent = REQUIRED
    elif field_info.default_factory is not None:
        absent = None  # a fresh default each time: the same absent body for every retry
    else:
        absent = field_info.default
    return CommandFingerprinter(
        field_info.annotation,
        excluded,
        json_without_content_type=not getattr(strict, "value", strict),
        absent=absent,
    )
