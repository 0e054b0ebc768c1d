"""The OpenAPI fragments the middleware adds: its error bodies in each ``error_format``,
the headers of its answers, and why each error happens."""

from __future__ import annotations

from typing import Any

from starlette_idempotency._keys import KeyFormat, key_pattern
from starlette_idempotency._responses import BODY_OMITTED_HEADER, Problem

Schema = dict[str, Any]

CODE = {
    "type": "string",
    "description": "What went wrong, for programs: a stable code.",
    "enum": [problem.code for problem in Problem],
}
KEY_EXAMPLE = "8e03978e-40d5-43e8-bc93-6894a57f9324"
FIRST_REQUEST = {
    "type": "object",
    "description": "On a 422: the request that first used the key, once it has finished (its "
    "status, and its Location when its response had one; never its body).",
    "required": ["status"],
    "properties": {
        "status": {"type": "integer"},
        "location": {"type": "string"},
    },
}


def key_schema(max_key_length: int, key_format: KeyFormat | None = None) -> Schema:
    """The schema of the key header's value: exactly the values the middleware accepts; under
    a ``key_format`` with a pattern, the unquoted keys of that format."""
    schema: Schema = {
        "type": "string",
        "minLength": 1,
        # the longest quoted string: every character escaped, between the quotes
        "maxLength": 2 * max_key_length + 2,
        "pattern": key_pattern(max_key_length),
    }
    if key_format is not None and key_format.pattern is not None:
        schema["maxLength"] = max_key_length
        schema["pattern"] = key_format.pattern
        if key_format.openapi_format is not None:
            schema["format"] = key_format.openapi_format
    return schema


JSON_ERROR: Schema = {
    "title": "IdempotencyError",
    "type": "object",
    "description": "An error the idempotency middleware answered with.",
    "required": ["error"],
    "properties": {
        "error": {"type": "string", "description": "What went wrong."},
        "code": CODE,
        "first_request": FIRST_REQUEST,
    },
}
STRIPE_ERROR: Schema = {
    "title": "IdempotencyStripeError",
    "type": "object",
    "description": "An error the idempotency middleware answered with, as Stripe's SDKs read it.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string"},
                "code": CODE,
                "message": {"type": "string", "description": "What went wrong."},
                "first_request": FIRST_REQUEST,
            },
        }
    },
}
PROBLEM_ERROR: Schema = {
    "title": "IdempotencyProblem",
    "type": "object",
    "description": "RFC 9457 problem details from the idempotency middleware.",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "description": "A URI reference naming the problem type."},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": CODE,
        "first_request": FIRST_REQUEST,
    },
}
CUSTOM_ERROR: Schema = {
    "title": "IdempotencyCustomError",
    "type": "object",
    "description": "An error of the idempotency middleware, as the application's "
    "error_format builds it.",
}
RECOVERY_PENDING: Schema = {
    "title": "IdempotencyRecoveryPending",
    "type": "object",
    "required": ["status", "checkpoint", "detail"],
    "properties": {
        "status": {"type": "string", "const": "requires_recovery"},
        "checkpoint": {"type": "string", "description": "The last recovery point reached."},
        "detail": {"type": "string"},
    },
}

RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same key.",
    "schema": {"type": "integer", "minimum": 1},
}
LOCATION = {
    "description": "The Location of the first response, when it had one.",
    "schema": {"type": "string"},
}


def success_headers(replay_header_name: str) -> Schema:
    """The headers a replay adds to a 2xx or 3xx answer."""
    return {
        replay_header_name: {
            "description": "`true` when this is the stored response of an earlier request with "
            "the same key, replayed instead of running the request again.",
            "schema": {"type": "string", "enum": ["true"]},
        },
        BODY_OMITTED_HEADER[0].title(): {
            "description": "`true` on a replay whose stored body was left out (it was larger "
            "than the route's max_response_bytes): the status and headers are the first "
            "response's.",
            "schema": {"type": "string", "enum": ["true"]},
        },
    }


# Why each error happens; the statuses and titles are the Problem's own.
CAUSES = {
    Problem.MISSING_KEY: "this route requires the key and none was sent.",
    Problem.INVALID_KEY: "the key is empty, longer than {max_key_length} characters, sent more "
    "than once, or not visible ASCII without commas (or an RFC 8941 quoted string).",
    Problem.INVALID_REQUEST: "Content-Length is not one decimal number.",
    Problem.BODY_TOO_LARGE: "the body is larger than {max_body_bytes} bytes, the most a "
    "guarded request may send.",
    Problem.IN_PROGRESS: "a request with this key is still running; retry with the same key "
    "after Retry-After seconds.",
    Problem.ALREADY_PROCESSED: "a request with this key already finished, and this route "
    "does not replay its response.",
    Problem.MISMATCH: "this key was already used with a different request.",
    Problem.STORE_UNAVAILABLE: "the idempotency store cannot be reached; retry with the same "
    "key after Retry-After seconds.",
    Problem.RESPONSE_UNREADABLE: "the stored response of this key cannot be decrypted (its key "
    "id is no longer configured); the request is not run again.",
}
