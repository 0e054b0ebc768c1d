"""Parsing the ``Idempotency-Key`` header value.

A key is either a token of visible ASCII (0x21-0x7E) but the comma, or an RFC 8941
Structured-Field string in double quotes (``"abc"`` means ``abc``; ``\\"`` and ``\\\\`` are its
only escapes), as the IETF draft writes it. A comma outside quotes is what a proxy makes of two
headers (``a,b``), so it is refused like two headers are. The length limit applies to the key
after unquoting.
"""

from __future__ import annotations

from dataclasses import dataclass


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
