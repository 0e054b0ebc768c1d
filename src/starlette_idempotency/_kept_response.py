"""What is kept of a response, and how a kept one is read back for a replay: the headers that
are never stored, a route's own header lists and redactor, and encryption at rest.

A finished response becomes its stored copy in four steps, each optional but the first:

1. its headers are filtered: hop-by-hop headers, ``Date``, ``Server``, the replay header and
   every credential-like header (:func:`never_stored`) are dropped, then what the route's
   ``stored_headers`` does not allow and what its ``never_stored_headers`` names;
2. a body that was not captured whole (larger than ``max_response_bytes``, or cut off) is left
   out, with ``X-Idempotent-Body-Omitted: true``;
3. the route's ``redact_response`` gets that copy and returns the one to keep (masked card
   numbers, say); its headers are filtered again and ``Content-Length`` follows its body. A
   redactor that raises keeps nothing but the status (fail closed: the key stays finished, and
   a replay is the status with ``X-Idempotent-Body-Omitted: true``);
4. with :class:`ResponseEncryption`, the headers and body are sealed with AES-GCM under the
   current key, bound to the record's storage key and status; the store sees ciphertext and
   the key id only.

A replay reads the copy back (:meth:`ResponseKeeper.read`): a sealed copy is opened with the key
its id names, a plain one (stored before encryption was turned on) is replayed as it is, and a
copy that cannot be opened (a key id no longer configured, a tampered record) is ``None``: the
middleware answers 503 rather than run the handler again or send what it cannot vouch for.
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from starlette_idempotency._record import StoredResponse
from starlette_idempotency._responses import BODY_HEADERS, BODY_OMITTED_HEADER
from starlette_idempotency.errors import ConfigurationError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

Redactor = Callable[[StoredResponse], StoredResponse]
"""``redact_response=``: gets the copy about to be stored, returns the copy to store instead."""

# Never stored: they describe one connection or one moment, or they are credentials that a
# replay would hand to whoever retries with the key.
NEVER_STORED_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "date",
        "server",
    }
)
#: A header whose name holds one of these is a credential, a session or a cookie: never stored.
NEVER_STORED_PARTS = (
    "auth",
    "cookie",
    "token",
    "secret",
    "password",
    "credential",
    "session",
    "api-key",
    "apikey",
)


@functools.lru_cache(maxsize=1024)
def never_stored(name: str) -> bool:
    """Whether a response header (lower-case ``name``) is never stored, whatever the options."""
    return (
        name in NEVER_STORED_HEADERS
        or name.startswith(":")  # not a field name; the sealed copy's own marker
        # CORS headers describe the response, not a credential (Allow-Credentials included)
        or (
            not name.startswith("access-control-")
            and any(part in name for part in NEVER_STORED_PARTS)
        )
    )


def _header_names(option: str, names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as a tuple, once checked to be a sequence of header names."""
    if isinstance(names, str | bytes) or not isinstance(names, Iterable):
        raise ConfigurationError(f"{option} must be a sequence of header names, not {names!r}")
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{option} must hold header names, not {name!r}")
    return names


@dataclass(frozen=True, slots=True)
class StoredParts:
    """What of a route's responses is stored: its header lists and redactor, checked once."""

    stored_headers: tuple[str, ...] | None = None
    never_stored_headers: tuple[str, ...] = ()
    redact: Redactor | None = None
    _allowed: frozenset[str] | None = field(init=False, repr=False, compare=False)
    _refused: frozenset[str] = field(init=False, repr=False, compare=False)
    #: :meth:`kept`'s answer for each header name seen so far (responses repeat their names).
    known: dict[str, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        allowed = None
        if self.stored_headers is not None:
            stored = _header_names("stored_headers", self.stored_headers)
            object.__setattr__(self, "stored_headers", stored)
            allowed = frozenset(name.lower() for name in stored)
            forbidden = sorted(name for name in allowed if never_stored(name))
            if forbidden:
                raise ConfigurationError(
                    f"stored_headers must not name {', '.join(forbidden)}: hop-by-hop headers, "
                    "Date, Server and credential-like headers (names holding "
                    f"{', '.join(NEVER_STORED_PARTS)}) are never stored"
                )
        refused_names = _header_names("never_stored_headers", self.never_stored_headers)
        object.__setattr__(self, "never_stored_headers", refused_names)
        refused = frozenset(name.lower() for name in refused_names)
        if self.redact is not None and not callable(self.redact):
            raise ConfigurationError(
                f"redact_response must be a callable taking and returning a StoredResponse, "
                f"not {self.redact!r}"
            )
        object.__setattr__(self, "_allowed", allowed)
        object.__setattr__(self, "_refused", refused)
        object.__setattr__(self, "known", {})

    def kept(self, name: str) -> bool:
        """Whether the response header ``name`` (lower case) is stored, the replay header
        aside (see :attr:`known`)."""
        kept = not (never_stored(name) or name in self._refused) and (
            self._allowed is None or name in self._allowed or name in BODY_HEADERS
        )
        if len(self.known) < _MAX_KNOWN_NAMES:
            self.known[name] = kept
        return kept


# Header names whose verdict a route remembers: responses repeat a few; a client cannot add any.
_MAX_KNOWN_NAMES = 512


#: The one header of a sealed copy: its scheme and key id (never a valid HTTP field name).
SEALED_HEADER = ":sealed"


class ResponseEncryption:
    """Encrypts stored response headers and bodies at rest with AES-GCM.

    ``keys`` maps key ids to keys: 16, 24 or 32 bytes (AES-128, -192, -256), as bytes or
    base64 text (:meth:`generate_key` makes one). New records are sealed with ``current`` (the
    only key, when there is one); every key in ``keys`` opens the records it sealed, so a
    rotation adds a new key as ``current`` and keeps the old one until the records it sealed
    have expired (``ttl_hours``). Each record names its key id, in clear; keys never reach
    the store. Needs the ``encryption`` extra (the ``cryptography`` package).
    """

    __slots__ = ("_current", "_keys")

    _SCHEME = "aes-gcm"
    _KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
    _NONCE_BYTES = 12

    def __init__(self, keys: Mapping[str, bytes | str], *, current: str | None = None) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:
            raise ImportError(
                "ResponseEncryption needs the cryptography package: "
                "pip install 'starlette-idempotency[encryption]'"
            ) from exc
        if not isinstance(keys, Mapping) or not keys:
            raise ConfigurationError("ResponseEncryption needs at least one key: {key_id: key}")
        if current is None:
            if len(keys) > 1:
                raise ConfigurationError(
                    "ResponseEncryption with several keys needs current=<key id>: the key new "
                    "records are sealed with"
                )
            current = next(iter(keys))
        if current not in keys:
            raise ConfigurationError(
                f"ResponseEncryption's current key id {current!r} is not among its keys "
                f"({', '.join(map(repr, keys))})"
            )
        self._keys: dict[str, AESGCM] = {}
        for key_id, key in keys.items():
            if not isinstance(key_id, str) or not self._KEY_ID.fullmatch(key_id):
                raise ConfigurationError(
                    f"ResponseEncryption key ids are 1 to 64 letters, digits, '.', '_' or '-', "
                    f"not {key_id!r}"
                )
            self._keys[key_id] = AESGCM(_key_bytes(key_id, key))
        self._current = current

    @staticmethod
    def generate_key() -> str:
        """A new random 256-bit key, as base64 text (for an environment variable or a vault)."""
        return base64.b64encode(os.urandom(32)).decode("ascii")

    @property
    def current_key_id(self) -> str:
        """The id of the key new records are sealed with."""
        return self._current

    def __repr__(self) -> str:
        # Middleware options are printed (Starlette's Middleware repr): never the keys.
        return f"ResponseEncryption(key_ids={list(self._keys)!r}, current={self._current!r})"

    def encrypt(self, response: StoredResponse, store_key: str) -> StoredResponse:
        """``response`` sealed for the record at ``store_key``: the status in clear, the
        headers and body as ciphertext, the key id in the one header it carries."""
        nonce = os.urandom(self._NONCE_BYTES)
        plain = orjson.dumps(response.headers) + b"\n" + response.body
        aad = _associated_data(self._current, response.status_code, store_key)
        sealed = nonce + self._keys[self._current].encrypt(nonce, plain, aad)
        marker = (SEALED_HEADER, f"{self._SCHEME};key={self._current}")
        return StoredResponse(response.status_code, (marker,), sealed, None)

    def decrypt(self, sealed: StoredResponse, store_key: str) -> StoredResponse | None:
        """What :meth:`encrypt` sealed, or ``None`` when it cannot be opened: its key id is not
        among the keys, or the record was changed (another record's copy, another status)."""
        scheme, _, key_id = sealed.headers[0][1].partition(";key=")
        aead = self._keys.get(key_id) if scheme == self._SCHEME else None
        if aead is None:
            return None
        nonce, ciphertext = sealed.body[: self._NONCE_BYTES], sealed.body[self._NONCE_BYTES :]
        try:
            plain = aead.decrypt(
                nonce, ciphertext, _associated_data(key_id, sealed.status_code, store_key)
            )
        except Exception:  # cryptography's InvalidTag, or a nonce of the wrong size
            return None
        head, _, body = plain.partition(b"\n")
        headers = tuple((str(name), str(value)) for name, value in orjson.loads(head))
        return StoredResponse(sealed.status_code, headers, body, _content_type(headers))


def _key_bytes(key_id: str, key: bytes | str) -> bytes:
    raw: bytes | None = key if isinstance(key, bytes) else None
    if isinstance(key, str):
        try:
            text = key.strip().replace("-", "+").replace("_", "/")  # either alphabet
            raw = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raw = None
    if raw is None or len(raw) not in (16, 24, 32):
        raise ConfigurationError(
            f"ResponseEncryption key {key_id!r} must be 16, 24 or 32 bytes, or their base64 "
            "(ResponseEncryption.generate_key() makes one)"
        )
    return raw


def _associated_data(key_id: str, status: int, store_key: str) -> bytes:
    """What a sealed copy is bound to: moved to another record, or given another status, it
    no longer opens."""
    return f"starlette-idempotency:aes-gcm\n{key_id}\n{status}\n{store_key}".encode(
        "utf-8", "surrogatepass"
    )


def _content_type(headers: Iterable[tuple[str, str]]) -> str | None:
    return next((value for name, value in headers if name == "content-type"), None)


class ResponseKeeper:
    """Turns a finished response into the copy the store keeps, and a kept copy back into
    the response a replay sends (the steps are the module's)."""

    __slots__ = ("_encoded_seen", "_encryption", "_replay_header_name", "replay_header")

    def __init__(
        self, *, replay_header_name: str, encryption: ResponseEncryption | None = None
    ) -> None:
        self._replay_header_name = replay_header_name.lower()
        #: The replay header's name as ASGI headers carry it (lower-case bytes).
        self.replay_header = self._replay_header_name.encode("latin-1")
        self._encryption = encryption
        self._encoded_seen = False

    def keep(
        self,
        parts: StoredParts,
        store_key: str,
        status: int,
        raw_headers: list[tuple[bytes, bytes]],
        body: bytes | None,
    ) -> tuple[StoredResponse, str | None]:
        """The copy of a response the store keeps (``body`` is ``None`` when it was not
        captured whole), and a note for the outcome event when the redactor failed."""
        replay_header = self._replay_header_name
        known = parts.known
        headers = []
        content_type = None
        for raw_name, raw_value in raw_headers:
            name = raw_name.decode("latin-1").lower()
            kept = known.get(name)
            if kept is None:
                kept = parts.kept(name)
            if not kept or name == replay_header or (body is None and name in BODY_HEADERS):
                continue
            value = raw_value.decode("latin-1")
            headers.append((name, value))
            if content_type is None and name == "content-type":
                content_type = value
            elif name == "content-encoding" and not self._encoded_seen:
                self._saw_encoding(value)
        if body is None:
            headers.append(BODY_OMITTED_HEADER)
        copy = StoredResponse(status, tuple(headers), body or b"", content_type)
        note = None
        if parts.redact is not None:
            copy, note = self._redacted(parts, copy)
        if self._encryption is not None:
            copy = self._encryption.encrypt(copy, store_key)
        return copy, note

    def _saw_encoding(self, coding: str) -> None:
        """Warn, once, that responses reach the middleware encoded: what compresses them runs
        inside it (whatever its name), so they are stored for the encoding the first client
        accepted."""
        if coding.strip().lower() in ("", "identity"):
            return
        self._encoded_seen = True
        logger.warning(
            "a response reached IdempotencyMiddleware with Content-Encoding: %s, so responses "
            "are stored compressed for whatever encoding the first client accepted (a replay "
            "is decoded again for a client that does not accept it). A compressing middleware "
            "(GZipMiddleware, say) runs inside IdempotencyMiddleware: add IdempotencyMiddleware "
            "before it (app.add_middleware(IdempotencyMiddleware, ...) first), so that it runs "
            "inside the compression and stores plain responses. A handler that encodes its own "
            "responses needs no change.",
            coding.strip(),
        )

    def _redacted(
        self, parts: StoredParts, copy: StoredResponse
    ) -> tuple[StoredResponse, str | None]:
        assert parts.redact is not None
        try:
            redacted: Any = parts.redact(copy)
            if not isinstance(redacted, StoredResponse):
                raise TypeError(f"it returned {type(redacted).__name__}, not a StoredResponse")
            body = bytes(redacted.body)
            headers = []
            for name, value in redacted.headers:
                if not isinstance(name, str) or not isinstance(value, str):
                    raise TypeError(f"its header {name!r}: {value!r} is not a pair of strings")
                name = name.lower()
                if name == "content-length":
                    value = str(len(body))
                kept = parts.kept(name) and name != self._replay_header_name
                if kept or name == BODY_OMITTED_HEADER[0]:
                    headers.append((name, value))
        except Exception:
            logger.exception(
                "redact_response %r failed, so only the status of this response is stored "
                "(a retry with its key gets the status, without headers or body)",
                parts.redact,
            )
            return StoredResponse(copy.status_code, (BODY_OMITTED_HEADER,), b"", None), (
                "redaction_failed"
            )
        return StoredResponse(copy.status_code, tuple(headers), body, _content_type(headers)), None

    def read(self, stored: StoredResponse, store_key: str) -> StoredResponse | None:
        """The response a replay sends for the copy stored at ``store_key``; ``None`` when a
        sealed copy cannot be opened."""
        if not stored.headers or stored.headers[0][0] != SEALED_HEADER:
            return stored  # stored in clear (before encryption was turned on, or without it)
        if self._encryption is None:
            return None
        return self._encryption.decrypt(stored, store_key)
