"""What the middleware adds to a FastAPI app's OpenAPI: the key header, its own answers, and
the replay headers.

FastAPI documents what its routes declare, and the middleware answers before them. So on the
first ASGI scope the middleware sees (the lifespan's, or the first request's), when
``scope["app"]`` is a FastAPI app whose routes are the ones this middleware guards,
:meth:`OpenAPIDocumenter.install` has its ``app.openapi()`` completed with what this
middleware does (:func:`~starlette_idempotency._openapi.install.install`). A Starlette app has
no OpenAPI and is left alone; so is a FastAPI app whose routes this middleware does not guard
(a middleware given to one ``Mount``). A FastAPI app mounted inside
another is documented by its own middleware, at its own first request (mounted apps get no
lifespan), which fetching its ``/openapi.json`` is.

An operation is documented when a request to it would be guarded: the routes are walked in the
router's order (:func:`~starlette_idempotency._routing.iter_routes`, which enters included
routers, prefixes and mounts as the route lookup does), the first route for a path and method
decides, the method must be one of ``methods``, and
:meth:`~starlette_idempotency._routing.RouteResolver.policy_for` merges the decorator's options
over the middleware's (or applies ``protect_all``). Each documented operation gets the key
header (``required`` as its policy says), every error the middleware can answer it with under
its policy (a 503 only when it fails closed, the "already processed" 409 only under
``replay="reject"``, the 202 only under ``on_recovery="hold"``), merged with what the route
declares at the same status (FastAPI's validation 422 stays; the bodies become ``anyOf`` both),
and the replay headers on its 2xx and 3xx responses.

Before the app has started there is no middleware yet, so no first scope: a script exporting
the schema calls :func:`~starlette_idempotency._openapi.install.install_openapi`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

from starlette.routing import BaseRoute, compile_path

from starlette_idempotency._openapi import fragments
from starlette_idempotency._openapi.fragments import Schema
from starlette_idempotency._openapi.install import fastapi_app, install
from starlette_idempotency._options import IdempotencyPolicy
from starlette_idempotency._responses import ErrorFormat, Problem
from starlette_idempotency._routing import RouteResolver, iter_routes, routes_for
from starlette_idempotency._types import ASGIApp, Scope


def _path_format(template: str) -> str:
    """The OpenAPI path of a route template (``/items/{id:int}`` is ``/items/{id}``)."""
    try:
        return compile_path(template)[1]
    except ValueError:  # a parameter named twice, across a mount: no OpenAPI path either
        return template


def _status_order(item: tuple[str, Any]) -> tuple[bool, str]:
    return (not item[0][:1].isdigit(), item[0])  # "default" after the statuses


class OpenAPIDocumenter:
    """Adds what one middleware does to the OpenAPI schema of the FastAPI app it guards."""

    def __init__(
        self,
        app: ASGIApp,
        resolver: RouteResolver,
        *,
        header_name: str,
        methods: Iterable[str],
        max_key_length: int,
        max_body_bytes: int,
        error_format: ErrorFormat,
        problem_type: str,
        replay_header_name: str,
        encryption: object | None,
    ) -> None:
        self._app = app
        self._encrypts = encryption is not None
        self._resolver = resolver
        self._header_name = header_name
        self._methods = frozenset(method.upper() for method in methods)
        self._max_key_length = max_key_length
        self._max_body_bytes = max_body_bytes
        self._replay_header_name = replay_header_name
        self._success_headers = fragments.success_headers(replay_header_name)
        self._media_type = "application/json"
        if callable(error_format):
            self._error_schema = fragments.CUSTOM_ERROR
        elif error_format == "problem":
            problem = dict(
                fragments.PROBLEM_ERROR, properties=dict(fragments.PROBLEM_ERROR["properties"])
            )
            problem["properties"]["type"] = {
                "type": "string",
                "description": "A URI reference naming the problem type: one per `code`.",
                "enum": sorted({problem.type_uri(problem_type) for problem in Problem}),
            }
            self._media_type, self._error_schema = "application/problem+json", problem
        else:
            self._error_schema = (
                fragments.STRIPE_ERROR if error_format == "stripe" else fragments.JSON_ERROR
            )

    def install(self, scope: Scope) -> None:
        """Document ``scope["app"]`` when it is a FastAPI app whose routes this middleware
        guards: from then on its ``app.openapi()`` includes the middleware."""
        app = fastapi_app(scope.get("app"))
        if app is None or routes_for(scope, self._app) is not app.routes:
            return
        install(app, self)

    def document(self, schema: Mapping[str, Any], routes: Iterable[BaseRoute]) -> Schema:
        """``schema`` with the guarded operations among ``routes`` documented; ``schema``
        itself is left as it was."""
        result = dict(schema)
        guarded = self._guarded_operations(routes)
        paths = dict(schema.get("paths") or {})
        components = dict(schema.get("components") or {})
        schemas = dict(components.get("schemas") or {})
        documented = False
        for (path, method), policy in guarded.items():
            item = paths.get(path)
            operation = item.get(method) if isinstance(item, Mapping) else None
            if not isinstance(item, Mapping) or not isinstance(operation, Mapping):
                continue  # not in the schema (include_in_schema=False, or not an APIRoute)
            paths[path] = {**item, method: self._operation(operation, policy, schemas)}
            documented = True
        if documented:
            result["paths"] = paths
            result["components"] = {**components, "schemas": schemas}
        return result

    def _guarded_operations(
        self, routes: Iterable[BaseRoute]
    ) -> dict[tuple[str, str], IdempotencyPolicy]:
        decided: dict[tuple[str, str], IdempotencyPolicy | None] = {}
        for entry in iter_routes(routes):
            path = _path_format(entry.template)
            for method in entry.methods:
                if (path, method.lower()) not in decided:  # the first route matches first
                    guarded = method in self._methods
                    policy = self._resolver.policy_for(entry.handler) if guarded else None
                    decided[path, method.lower()] = policy
        return {operation: policy for operation, policy in decided.items() if policy}

    def _operation(
        self, operation: Mapping[str, Any], policy: IdempotencyPolicy, schemas: Schema
    ) -> Schema:
        parameters = list(operation.get("parameters") or [])
        source = policy.key_source
        header_name = self._header_name if source is None else source.name
        if (source is None or source.header_bytes) and not any(
            isinstance(parameter, Mapping)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == header_name.lower()
            for parameter in parameters
        ):
            parameters.append(self._key_parameter(policy, header_name))
        # An override may have added statuses as numbers; in JSON they are strings either way.
        responses = {
            str(code): answer for code, answer in (operation.get("responses") or {}).items()
        }
        for code, response in responses.items():
            if (
                policy.replay == "response"  # under "reject", a retry gets a 409 instead
                and code[:1] in ("2", "3")
                and isinstance(response, Mapping)
                and "$ref" not in response
            ):
                responses[code] = _with_headers(response, self._success_headers)
        error = _component(schemas, self._error_schema)
        for status, description, headers in self._errors(policy):
            responses[str(status)] = _merged(
                responses.get(str(status)), description, self._media_type, error, headers
            )
        if policy.on_recovery == "hold":
            description = (
                "The first request with this key stopped after a recovery point and is being "
                "reconciled: retry later with the same key."
            )
            responses["202"] = _merged(
                responses.get("202"),
                description,
                "application/json",
                _component(schemas, fragments.RECOVERY_PENDING),
                {},
            )
        return {
            **operation,
            "parameters": parameters,
            "responses": dict(sorted(responses.items(), key=_status_order)),
        }

    def _key_parameter(self, policy: IdempotencyPolicy, header_name: str) -> Schema:
        hours = f"{policy.ttl_hours:g} hour{'' if policy.ttl_hours == 1 else 's'}"
        key_format = policy.key_check
        if policy.replay == "reject":
            retry = "a retry of a finished request is refused (409) rather than run again"
        else:
            retry = (
                "a retry of a finished request gets its first response back, marked "
                f"`{self._replay_header_name}: true`, instead of running again"
            )
        description = (
            "Makes this request safe to retry: send a new unique key (a UUID, say) with each "
            f"new request, and the same key with each retry of it. With the same key, {retry}; "
            "a different request with it is refused (422). A key is remembered for "
            f"{hours} after its request finished. Visible ASCII without commas (or an RFC 8941 "
            f"quoted string), at most {self._max_key_length} characters once unquoted"
            + ("" if key_format is None else f", and {key_format.requirement}")
            + ". "
            + (
                "Required."
                if policy.required
                else "Optional: a request without it runs unprotected, as if it were new."
            )
        )
        return {
            "name": header_name,
            "in": "header",
            "required": policy.required,
            "description": description,
            "schema": fragments.key_schema(self._max_key_length, key_format),
            "example": fragments.KEY_EXAMPLE,
        }

    def _errors(self, policy: IdempotencyPolicy) -> list[tuple[int, str, Schema]]:
        """(status, description, headers) of each error status this policy can answer with."""
        problems = [Problem.INVALID_KEY, Problem.INVALID_REQUEST, Problem.BODY_TOO_LARGE]
        problems += [Problem.IN_PROGRESS, Problem.MISMATCH]
        if policy.required:
            problems.insert(0, Problem.MISSING_KEY)
        if policy.replay == "reject":
            problems.append(Problem.ALREADY_PROCESSED)
        if policy.on_store_error == "fail_closed":
            problems.append(Problem.STORE_UNAVAILABLE)
        if self._encrypts:
            problems.append(Problem.RESPONSE_UNREADABLE)
        statuses = sorted({problem.status for problem in problems})
        source = policy.key_source
        key_name = self._header_name if source is None else source.label
        causes = dict(fragments.CAUSES)
        if policy.key_check is not None:
            causes[Problem.INVALID_KEY] += f" Or it is not {policy.key_check.requirement}."
        if source is not None and source.json_path:
            causes[Problem.INVALID_REQUEST] += (
                f" Or the body is not JSON (this route reads its key from {key_name})."
            )
        errors = []
        for status in statuses:
            lines = [
                f"- **{problem.title.format(header=key_name)}**: "
                + causes[problem].format(
                    max_key_length=self._max_key_length, max_body_bytes=self._max_body_bytes
                )
                for problem in problems
                if problem.status == status
            ]
            headers: Schema = {}
            if any(
                problem in problems and problem.status == status
                for problem in (Problem.IN_PROGRESS, Problem.STORE_UNAVAILABLE)
            ):
                headers["Retry-After"] = fragments.RETRY_AFTER
            if Problem.ALREADY_PROCESSED in problems and Problem.ALREADY_PROCESSED.status == status:
                headers["Location"] = fragments.LOCATION
            errors.append(
                (status, "From the idempotency middleware:\n\n" + "\n".join(lines), headers)
            )
        return errors


def _component(schemas: Schema, schema: Schema) -> Schema:
    """A reference to ``schema`` among the components, or ``schema`` itself where its name is
    taken by another."""
    name = schema["title"]
    if schemas.setdefault(name, schema) == schema:
        return {"$ref": f"#/components/schemas/{name}"}
    return schema


def _with_headers(response: Mapping[str, Any], headers: Mapping[str, Any]) -> Schema:
    return {**response, "headers": {**headers, **(response.get("headers") or {})}}


def _merged(
    declared: Any, description: str, media_type: str, body: Schema, headers: Schema
) -> Schema:
    """The middleware's answer at a status, beside what the route declares there."""
    if declared is None:
        answer: Schema = {"description": description, "content": {media_type: {"schema": body}}}
        return _with_headers(answer, headers) if headers else answer
    if not isinstance(declared, Mapping) or "$ref" in declared:
        return cast(Schema, declared)  # a shared response object: the route's word stands
    content = dict(declared.get("content") or {})
    existing = content.get(media_type)
    if isinstance(existing, Mapping) and "schema" in existing:
        content[media_type] = {**existing, "schema": {"anyOf": [existing["schema"], body]}}
    else:
        content[media_type] = {"schema": body}
    own = str(declared.get("description") or "")
    merged = {
        **declared,
        "description": f"{own}\n\n{description}" if own else description,
        "content": content,
    }
    return _with_headers(merged, headers) if headers else merged
