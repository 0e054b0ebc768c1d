"""The idempotency key: the header value parsed, whom its keys belong to, and the storage key.

A key is either a token of visible ASCII (0x21-0x7E) but the comma, or an RFC 8941
Structured-Field string in double quotes (``"abc"`` means ``abc``; ``\\"`` and ``\\\\`` are its
only escapes), as the IETF draft writes it. A comma outside quotes is what a proxy makes of two
headers (``a,b``), so it is refused like two headers are. The length limit applies to the key
after unquoting.

A key belongs to the request's owner: ``key_scope``'s answer, or the authenticated user
(:class:`KeyScopeResolver`). The store keeps its record under :func:`storage_key`: the owner,
the method, the route's template and the key.

A route may take its key from elsewhere (``key_from``): another header, a field of the JSON
body, or a function of the request and its body (:class:`KeySource`). Whatever the source, the
key is held to the same rules: 1 to ``max_key_length`` printable ASCII characters, the keys a
header can carry (quoted, for spaces and commas). ``key_format`` narrows them further
(:class:`KeyFormat`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection

from starlette_idempotency._fingerprint import ParsedJson, parse_json
from starlette_idempotency._types import HTTP_TOKEN, Body, Scope
from starlette_idempotency.errors import ConfigurationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InvalidKey:
    """Why a header value is not a usable key (``message`` is ready for the client)."""

    message: str
    too_long: bool = False
    #: The body a key is read from is not JSON: the request is malformed, not its key.
    malformed: bool = False
    #: A well-formed key the route's ``key_format`` refuses.
    by_format: bool = False


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


def parse_key(
    raw: bytes, *, header_name: str, max_length: int, key_format: KeyFormat | None = None
) -> str | InvalidKey:
    """The key a header value carries, or the reason it is invalid (or not of ``key_format``)."""
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
    if not key or len(key) > max_length:
        return check_key(key, name=header_name, max_length=max_length)
    return key if key_format is None else key_format.checked(key, header_name)


def check_key(
    key: str, *, name: str, max_length: int, key_format: KeyFormat | None = None
) -> str | InvalidKey:
    """``key`` if it is 1 to ``max_length`` printable ASCII characters (what a header carries
    once unquoted) and of ``key_format``, else the reason it is not; ``name`` names its source
    in the message."""
    if not key:
        return InvalidKey(f"{name} must not be empty")
    if not (key.isascii() and key.isprintable()):
        return InvalidKey(f"{name} must contain only printable ASCII characters")
    if len(key) > max_length:
        return InvalidKey(f"{name} must not exceed {max_length} characters", too_long=True)
    return key if key_format is None else key_format.checked(key, name)


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


KeyFunction = Callable[[HTTPConnection, bytes], str | Awaitable[str | None] | None]
"""Returns a request's idempotency key, read from the request and its body, or ``None`` when
it has none; sync or async (``key_from=``)."""

# Credentials must not become keys: a store would keep them, and logs would show them.
_CREDENTIAL_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
_NOT_FOUND: Any = object()


class KeySource:
    """Where a route's idempotency key comes from, when not from the middleware's
    ``header_name`` header (``key_from=``): :meth:`header`, :meth:`json_field`, or a
    :data:`KeyFunction` given as it is. Build one with those, not with the constructor."""

    __slots__ = ("_function", "header_bytes", "json_path", "label", "name")

    def __init__(
        self,
        name: str,
        label: str,
        *,
        header: bool = False,
        path: tuple[str, ...] = (),
        function: KeyFunction | None = None,
    ) -> None:
        #: The header's name, the JSON path or the function, as given.
        self.name = name
        #: The key as messages and error titles name it.
        self.label = label
        #: The header's name as ASGI headers spell it, for a header source; else empty.
        self.header_bytes = name.lower().encode("latin-1") if header else b""
        #: The path's segments, for a JSON field source; else empty.
        self.json_path = path
        self._function = function

    @classmethod
    def header(cls, name: str) -> KeySource:
        """The key is the value of the header ``name`` (``webhook-id``, ``X-GitHub-Delivery``),
        read as ``Idempotency-Key`` is."""
        if not isinstance(name, str) or not HTTP_TOKEN.fullmatch(name):
            raise ConfigurationError(
                f"KeySource.header() takes an HTTP header name such as 'webhook-id', not {name!r}"
            )
        if name.lower() in _CREDENTIAL_HEADERS:
            raise ConfigurationError(
                f"KeySource.header({name!r}) would keep credentials as idempotency keys in the "
                "store and the logs: take the key from a header of its own"
            )
        return cls(name, name, header=True)

    @classmethod
    def json_field(cls, path: str) -> KeySource:
        """The key is a string or integer field of the JSON body, at the dotted ``path``
        (``"id"``, ``"data.id"``; a segment of digits indexes an array: ``"items.0.id"``)."""
        segments = path.split(".") if isinstance(path, str) else []
        if not segments or not all(segments):
            raise ConfigurationError(
                "KeySource.json_field() takes a dotted path of field names such as 'data.id', "
                f"not {path!r}"
            )
        return cls(path, f"JSON field {path}", path=tuple(segments))

    @classmethod
    def of(cls, key_from: object) -> KeySource:
        """The source a ``key_from=`` value names: a :class:`KeySource`, or a function of the
        request and its body."""
        if isinstance(key_from, KeySource):
            return key_from
        if isinstance(key_from, str):
            raise ConfigurationError(
                f"key_from takes a KeySource, not the string {key_from!r}: "
                f"KeySource.header({key_from!r}) or KeySource.json_field({key_from!r})"
            )
        if not callable(key_from):
            raise ConfigurationError(
                "key_from must be KeySource.header(name), KeySource.json_field(path) or a "
                f"function (request, body) -> str | None, not {key_from!r}"
            )
        try:
            inspect.signature(key_from).bind(None, b"")
        except TypeError as exc:
            raise ConfigurationError(
                f"key_from {key_from!r} must take two arguments, the request and its body: {exc}"
            ) from exc
        except ValueError:  # no signature to read (a builtin): trusted as it is
            pass
        return cls(
            getattr(key_from, "__qualname__", repr(key_from)), "Idempotency key", function=key_from
        )

    def _identity(self) -> tuple[object, ...]:
        return (self.name, self.header_bytes, self.json_path, self._function)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeySource):
            return NotImplemented
        return self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        if self.header_bytes:
            return f"KeySource.header({self.name!r})"
        if self.json_path:
            return f"KeySource.json_field({self.name!r})"
        return f"KeySource({self._function!r})"

    def missing_message(self) -> str:
        """What a required route answers a request whose source yields no key."""
        if self.header_bytes:
            return f"{self.name} header is required"
        if self.json_path:
            return f"JSON field {self.name} (the idempotency key) is required"
        return f"An idempotency key is required: key_from {self.name} found none in the request"

    async def read(
        self, scope: Scope, body: Body, *, max_length: int, key_format: KeyFormat | None
    ) -> tuple[str | InvalidKey | None, ParsedJson | None]:
        """The key a body source finds in a request (``None`` when it finds none), checked
        as :func:`check_key` does, and the body as JSON when it was parsed for it."""
        if not self.json_path:
            assert self._function is not None
            value = await call_hook(self._function, "key_from", scope, bytes(body))
            if value is None:
                return None, None
            if not isinstance(value, str):
                raise TypeError(
                    f"key_from {self._function!r} returned {value!r}, not a str or None"
                )
            return check_key(
                value, name=self.label, max_length=max_length, key_format=key_format
            ), None
        parsed = parse_json(body)
        if parsed is None:
            problem = InvalidKey(
                f"The body must be JSON: this route reads its idempotency key from {self.label}",
                malformed=True,
            )
            return problem, None
        value = field_at(parsed.value, self.json_path)
        if type(value) is float and parsed.by_orjson:
            # orjson reads an integer beyond 64 bits as a float; the standard library whole.
            with contextlib.suppress(ValueError, RecursionError):
                value = field_at(json.loads(body), self.json_path)
        if value is _NOT_FOUND or value is None:
            return None, parsed
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            message = f"{self.label} must be a string or an integer, not {type(value).__name__}"
            return InvalidKey(message), parsed
        checked = check_key(value, name=self.label, max_length=max_length, key_format=key_format)
        return checked, parsed


def field_at(value: Any, path: tuple[str, ...]) -> Any:
    """The member of a parsed JSON ``value`` at ``path`` (object members by name, array items
    by a segment of digits), or ``_NOT_FOUND``."""
    for segment in path:
        if type(value) is dict:
            value = value.get(segment, _NOT_FOUND)
        elif type(value) is list and segment.isdigit() and segment.isascii():
            index = int(segment)
            value = value[index] if index < len(value) else _NOT_FOUND
        else:
            return _NOT_FOUND
        if value is _NOT_FOUND:
            return value
    return value


# RFC 9562's textual form, as str(uuid.UUID(...)) writes it.
_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


class KeyFormat:
    """Which keys a route accepts beyond the syntax every key has (``key_format=``)."""

    __slots__ = ("_accepts", "openapi_format", "pattern", "requirement")

    def __init__(
        self,
        accepts: Callable[[str], object],
        requirement: str,
        pattern: str | None = None,
        openapi_format: str | None = None,
    ) -> None:
        self._accepts = accepts
        #: What a refused key is told it must be.
        self.requirement = requirement
        #: The pattern of the keys accepted, anchored, for OpenAPI; ``None`` for a function.
        self.pattern = pattern
        self.openapi_format = openapi_format

    @classmethod
    def of(cls, key_format: object) -> KeyFormat:
        """The format a ``key_format=`` value names: ``"uuid"``, a regular expression the whole
        key must match (a string, or compiled), or a predicate ``str -> bool``."""
        if key_format == "uuid":
            return cls(
                re.compile(_UUID).fullmatch,
                "a UUID in its canonical text form (8-4-4-4-12 lower-case hexadecimal digits)",
                f"^{_UUID}$",
                "uuid",
            )
        if isinstance(key_format, re.Pattern) and isinstance(key_format.pattern, str):
            return cls._regex(key_format)
        if isinstance(key_format, str):
            if key_format.lower() == "uuid":
                raise ConfigurationError(
                    f"key_format={key_format!r} would be a regular expression matching only "
                    "itself: write key_format='uuid' for UUIDs"
                )
            if not key_format:
                raise ConfigurationError("key_format must not be an empty regular expression")
            try:
                compiled = re.compile(key_format)
            except re.error as exc:
                raise ConfigurationError(
                    f"key_format {key_format!r} is not a valid regular expression: {exc}"
                ) from exc
            return cls._regex(compiled)
        if callable(key_format):
            refuse_async_predicate(key_format, "key_format", "str -> bool")
            name = getattr(key_format, "__qualname__", repr(key_format))
            accepts = key_format

            def accepted(key: str) -> bool:
                return predicate_answer(accepts(key), "key_format")

            return cls(accepted, f"a key {name} accepts")
        raise ConfigurationError(
            "key_format must be 'uuid', a regular expression or a function str -> bool, "
            f"not {key_format!r}"
        )

    @classmethod
    def _regex(cls, compiled: re.Pattern[str]) -> KeyFormat:
        """The whole key must match ``compiled``. Its pattern is shown in OpenAPI unless it has
        flags (``(?i)``, ``re.IGNORECASE``), which a JSON Schema pattern cannot carry."""
        text = compiled.pattern
        shown = None if compiled.flags & ~re.UNICODE else f"^(?:{text})$"
        return cls(compiled.fullmatch, f"a key matching {text}", shown)

    def checked(self, key: str, name: str) -> str | InvalidKey:
        """``key`` (from ``name``) if it is of this format, else why it is refused."""
        if self._accepts(key):
            return key
        return InvalidKey(f"{name} must be {self.requirement}", by_format=True)


def refuse_async_predicate(predicate: Callable[..., object], option: str, signature: str) -> None:
    """Refuse an ``async def`` (or an object whose ``__call__`` is one) as the predicate
    ``option``. A predicate is called on the request path, never awaited: the coroutine it
    returns is true whatever it would have decided."""
    if inspect.iscoroutinefunction(inspect.unwrap(predicate)) or inspect.iscoroutinefunction(
        type(predicate).__call__
    ):
        name = getattr(predicate, "__qualname__", repr(predicate))
        raise ConfigurationError(
            f"{option} must be a plain function {signature} (def, not async def), not {name}: "
            "the coroutine an async function returns is always true"
        )


def predicate_answer(answer: object, option: str) -> bool:
    """What the predicate ``option`` answered. An awaitable (an async function behind a
    wrapper :func:`refuse_async_predicate` cannot see through) is refused, never taken as
    true."""
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()  # never awaited: no "was never awaited" warning
        raise ConfigurationError(
            f"{option} returned an awaitable: it must be a plain function (def, not async def)"
        )
    return bool(answer)


async def call_hook(hook: Callable[..., Any], option: str, scope: Scope, *args: Any) -> Any:
    """``hook(HTTPConnection(scope), *args)``, awaited if it returns an awaitable.

    An ``HTTPException`` is the app's own answer (a 401 for a bad token, say), raised for the
    request to send; anything else is logged with what to do (:func:`_hook_failed`), and
    raised (a 500).
    """
    try:
        value = hook(HTTPConnection(scope), *args)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:
        _hook_failed(exc, option, hook, scope)
        raise
    return value


def _hook_failed(exc: Exception, option: str, hook: Callable[..., Any], scope: Scope) -> None:
    """Log what ``hook`` raised, unless it is the app's own answer (an ``HTTPException``)."""
    if not isinstance(exc, HTTPException):
        logger.exception(
            "%s %r raised on %s %s, so the request fails with a 500; to refuse "
            "a request (a missing or expired token), raise an HTTPException from it",
            option,
            hook,
            scope.get("method"),
            scope.get("path"),
        )


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

    __slots__ = ("_key_scope", "_warned", "owner")

    def __init__(self, key_scope: KeyScope | None) -> None:
        self._key_scope = key_scope
        self._warned: set[str] = set()
        #: The owner of a request's keys, given its scope: a ``str``, or an awaitable of one
        #: when ``key_scope`` answers with one. Chosen here, so that a sync ``key_scope`` costs
        #: a request one call of ours.
        self.owner: Callable[[Scope], str | Awaitable[str]] = (
            self._user if key_scope is None else self._hooked
        )

    def _hooked(self, scope: Scope) -> str | Awaitable[str]:
        """``key_scope``'s answer (as :func:`call_hook` calls a hook)."""
        hook = self._key_scope
        assert hook is not None
        try:
            value = hook(HTTPConnection(scope))
        except Exception as exc:
            _hook_failed(exc, "key_scope", hook, scope)
            raise
        if inspect.isawaitable(value):
            return self._awaited(hook, value, scope)
        return "" if value is None else str(value)

    @staticmethod
    async def _awaited(hook: KeyScope, value: Awaitable[str | None], scope: Scope) -> str:
        try:
            owner = await value
        except Exception as exc:
            _hook_failed(exc, "key_scope", hook, scope)
            raise
        return "" if owner is None else str(owner)

    def _user(self, scope: Scope) -> str:
        """The authenticated user's identity, with no ``key_scope``."""
        user = scope.get("user")
        if user is None:
            self._warn_once(_UNSCOPED_WARNING)
            return ""
        if not getattr(user, "is_authenticated", False):
            self._warn_once(_ANONYMOUS_WARNING)
            return ""
        try:
            identity = user.identity
        except (AttributeError, NotImplementedError) as exc:
            if isinstance(exc, AttributeError) and hasattr(type(user), "identity"):
                raise  # from inside the class's own identity: no fallback stands for it
            # Imported here: an app with no user in its scopes never loads it.
            from starlette.authentication import SimpleUser

            # A SimpleUser's username is who it is (it has no identity unless a subclass
            # gives it one, read above).
            identity = user.username if isinstance(user, SimpleUser) else None
        if identity is None or identity == "":
            # A display name is not unique: two users of one name would share their keys, and
            # each could be answered with the other's stored responses.
            raise ConfigurationError(
                f"the authenticated user in scope['user'] ({type(user).__qualname__}) has no "
                "identity, so the idempotency keys of its requests cannot be scoped to it: give "
                "the user class an identity property (a unique id), or pass key_scope= to "
                "IdempotencyMiddleware"
            )
        return str(identity)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)


_KEY_PART_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})
# What the escapes replace, besides the colon (which the joining colons are told apart from).
_ESCAPED_BESIDES_COLON = re.compile("[%{}]")


def storage_key(scope_id: str, method: str, route_template: str, key: str) -> str:
    """``scope:METHOD:template:key``, each part escaped so that no two tuples share a key.

    The store adds its prefix (``idempotency:`` by default). Braces are escaped too, so Redis
    Cluster never reads a route template's ``{param}`` as a hash tag.
    """
    joined = f"{scope_id}:{method}:{route_template}:{key}"
    if joined.count(":") == 3 and _ESCAPED_BESIDES_COLON.search(joined) is None:
        return joined  # nothing to escape in any part (most keys): two scans, no translation
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
