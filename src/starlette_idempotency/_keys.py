"""The idempotency key: the header value parsed, whom its keys belong to, and the storage key.

A key is either a token of visible ASCII (0x21-0x7E) but the comma, or an RFC 8941
Structured-Field string in double quotes (``"abc"`` means ``abc``; ``\\"`` and ``\\\\`` are its
only escapes), as the IETF draft writes it. A comma outside quotes is what a proxy makes of two
headers (``a,b``), so it is refused like two headers are. The length limit applies to the key
after unquoting.

A key belongs to the request's owner: ``key_scope``'s answer, or the authenticated user
(:class:`KeyScopeResolver`). The store keeps its record under :func:`storage_key`: the owner,
the method, the route's template and the key.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection

from starlette_idempotency._types import Scope

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InvalidKey:
    """Why a header value is not a usable key (``message`` is ready for the client)."""

    message: str
    too_long: bool = False


def _unquote_sf_string(raw: str) -> str | None:
    if len(raw) < 2 or not raw.endswith('"'):
        return None
    out: list[str] = []
    chars = iter(raw[1:-1])
    for char in chars:
        if char == "\\":
            escaped = next(chars, None)
            if escaped not in ('"', "\\"):
                return None
            out.append(escaped)
        elif char == '"' or not " " <= char <= "~":
            return None
        else:
            out.append(char)
    return "".join(out)


def sent_once_message(header_name: str) -> str:
    return f"{header_name} must be sent only once (an unquoted key cannot contain a comma)"


def parse_key(raw: bytes, *, header_name: str, max_length: int) -> str | InvalidKey:
    """The key a header value carries, or the reason it is invalid."""
    try:
        text = raw.decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.startswith('"'):
        unquoted = _unquote_sf_string(text)
        if unquoted is None:
            return InvalidKey(
                f"{header_name} is not a valid quoted string "
                '(printable ASCII inside double quotes, escaping only \\" and \\\\)'
            )
        key = unquoted
    elif text is None or not text.isprintable() or " " in text:
        return InvalidKey(
            f"{header_name} must contain only visible ASCII characters "
            "(no spaces or control characters), or be a quoted string"
        )
    elif "," in text:
        # What a proxy makes of two headers: "a,b". A comma is only allowed quoted.
        return InvalidKey(sent_once_message(header_name))
    else:
        key = text
    if not key:
        return InvalidKey(f"{header_name} must not be empty")
    if len(key) > max_length:
        return InvalidKey(f"{header_name} must not exceed {max_length} characters", too_long=True)
    return key


def key_pattern(max_length: int) -> str:
    """A regular expression (ECMA-262 and Python alike) that matches exactly the header values
    :func:`parse_key` accepts with ``max_length``, once the field's surrounding whitespace is
    gone (HTTP strips it): for the ``pattern`` of the header's OpenAPI schema.

    A token starts with anything visible but the comma and ``"`` (a value starting with
    ``"`` is a quoted string), and goes on with anything visible but the comma; a quoted
    string holds printable ASCII, ``"`` and ``\\`` only escaped. Either holds 1 to
    ``max_length`` characters of key.
    """
    first, rest = r"[!#-+\--~]", r"[!-+\--~]"
    quoted = r'(?:[ !#-\[\]-~]|\\["\\])'
    return rf'^(?:{first}{rest}{{0,{max_length - 1}}}|"{quoted}{{1,{max_length}}}")$'


KeyScope = Callable[[HTTPConnection], "str | Awaitable[str | None] | None"]
"""Returns the owner of a request's keys (a user or tenant id); sync or async."""

_UNSCOPED_WARNING = (
    "Idempotency keys are not scoped to a user: no key_scope was given and no "
    "authentication middleware set scope['user'], so two clients sending the same key "
    "share one stored response. Pass key_scope= or add the authentication middleware "
    "outside IdempotencyMiddleware."
)
_ANONYMOUS_WARNING = (
    "Idempotency keys of unauthenticated requests are not scoped to anyone: scope['user'] is "
    "not authenticated, so two anonymous clients sending the same key share one stored "
    "response. Require authentication on guarded routes, or pass key_scope= to scope their "
    "keys (by API key, session or client id)."
)


class KeyScopeResolver:
    """Names the owner of a request's keys; warns once when requests share one owner."""

    __slots__ = ("_key_scope", "_warned")

    def __init__(self, key_scope: KeyScope | None) -> None:
        self._key_scope = key_scope
        self._warned: set[str] = set()

    async def __call__(self, scope: Scope) -> str:
        if self._key_scope is not None:
            try:
                value = self._key_scope(HTTPConnection(scope))
                if inspect.isawaitable(value):
                    value = await value
            except HTTPException:
                raise  # the app's own answer (a 401 for a bad token, say): the request sends it
            except Exception:
                logger.exception(
                    "key_scope %r raised on %s %s, so the request fails with a 500; to refuse "
                    "a request (a missing or expired token), raise an HTTPException from it",
                    self._key_scope,
                    scope.get("method"),
                    scope.get("path"),
                )
                raise
            return "" if value is None else str(value)
        user = scope.get("user")
        if user is None:
            self._warn_once(_UNSCOPED_WARNING)
            return ""
        if not getattr(user, "is_authenticated", False):
            self._warn_once(_ANONYMOUS_WARNING)
            return ""
        try:
            identity = user.identity
        except (AttributeError, NotImplementedError):
            identity = None
        return str(identity or getattr(user, "display_name", "") or "")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)


_KEY_PART_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})


def storage_key(scope_id: str, method: str, route_template: str, key: str) -> str:
    """``scope:METHOD:template:key``, each part escaped so that no two tuples share a key.

    The store adds its prefix (``idempotency:`` by default). Braces are escaped too, so Redis
    Cluster never reads a route template's ``{param}`` as a hash tag.
    """
    escapes = _KEY_PART_ESCAPES
    return (
        f"{scope_id.translate(escapes)}:{method.translate(escapes)}:"
        f"{route_template.translate(escapes)}:{key.translate(escapes)}"
    )


_KEY_PART_UNESCAPES = re.compile("%(25|3A|7B|7D)")


def split_storage_key(key: str) -> tuple[str, str, str, str] | None:
    """The scope, method, route template and key that :func:`storage_key` joined into
    ``key``; ``None`` for a key it did not build."""
    parts = key.split(":")
    if len(parts) != 4:
        return None
    scope_id, method, route_template, client_key = (
        _KEY_PART_UNESCAPES.sub(lambda match: chr(int(match[1], 16)), part) for part in parts
    )
    return scope_id, method, route_template, client_key
