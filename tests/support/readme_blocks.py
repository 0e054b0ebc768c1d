"""Reading README.md the way ``tests/test_readme.py`` runs it: fenced code blocks, the markers
before them, and the curl transcripts of the quick starts.

The rules the README follows:

- A fenced block is taken with its language (the first word of the info string) and the line
  of its opening fence. Fences are CommonMark's: three or more backticks or tildes, indented by
  at most three spaces, closed by the same character at least as many times.
- ``<!-- readme-test: context=NAME -->`` or ``<!-- readme-test: skip (reason) -->`` on the
  lines right before a block (blank lines may stand between) is that block's marker. A marker
  anywhere else, or one that says anything else, is an error: nothing is ignored silently.
- A transcript is a block whose lines start with the prompt ``$ ``: each ``$ curl`` command
  (continued onto the next line by a trailing backslash) is followed by the response it gets,
  as ``curl -si`` prints it: the status line, the headers worth showing, the body.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
"""Info strings of the blocks that are run."""

PROMPT = "$ "


class ReadmeError(ValueError):
    """README.md breaks a rule its test reads it by; the message names the line."""


@dataclass(frozen=True, slots=True)
class Marker:
    """A ``<!-- readme-test: ... -->`` comment: the block after it runs with the names of the
    test's context ``context``, or is skipped for ``skip``, the reason given."""

    line: int
    context: str | None = None
    skip: str | None = None


@dataclass(frozen=True, slots=True)
class Block:
    """A fenced code block. ``line`` is the 1-based line of its opening fence, so its code
    starts on line ``line + 1``."""

    language: str
    line: int
    source: str
    marker: Marker | None = None

    @property
    def is_python(self) -> bool:
        return self.language.lower() in PYTHON_LANGUAGES

    @property
    def is_transcript(self) -> bool:
        return any(line.startswith(PROMPT) for line in self.source.splitlines())


_FENCE = re.compile(r"(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)")
_MARKER = re.compile(r"\s*<!--\s*readme-test:(?P<body>.*?)-->\s*")
_SKIP = re.compile(r"skip\s*\((?P<reason>[^()]*\S[^()]*)\)")
_CONTEXT = re.compile(r"context=(?P<name>[a-z][a-z0-9-]*)")


def _marker(body: str, line: int) -> Marker:
    body = body.strip()
    if skip := _SKIP.fullmatch(body):
        return Marker(line, skip=skip["reason"].strip())
    if context := _CONTEXT.fullmatch(body):
        return Marker(line, context=context["name"])
    raise ReadmeError(
        f"README.md:{line}: a readme-test marker says 'context=NAME' or 'skip (reason)', "
        f"not {body!r}"
    )


def read_blocks(text: str) -> list[Block]:
    """Every fenced code block of ``text``, in order, each with the marker right before it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: Marker | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        if "<!--" in line and "readme-test" in line:
            found = _MARKER.fullmatch(line)
            if found is None:
                raise ReadmeError(
                    f"README.md:{index + 1}: write a readme-test marker alone on its line, "
                    "as <!-- readme-test: ... -->"
                )
            if pending is not None:
                raise ReadmeError(f"README.md:{pending.line}: two markers for one block")
            pending = _marker(found["body"], index + 1)
            index += 1
            continue
        opening = _FENCE.fullmatch(line)
        if opening is None:
            if pending is not None and line.strip():
                raise ReadmeError(
                    f"README.md:{pending.line}: a readme-test marker must stand right before "
                    "a code block"
                )
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        closing = re.compile(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*")
        end = next(
            (at for at in range(index + 1, len(lines)) if closing.fullmatch(lines[at])), None
        )
        if end is None:
            raise ReadmeError(f"README.md:{index + 1}: code block never closed")
        body = [_dedent(text_line, indent) for text_line in lines[index + 1 : end]]
        info = opening["info"].split()
        blocks.append(
            Block(info[0] if info else "", index + 1, "".join(f"{b}\n" for b in body), pending)
        )
        pending = None
        index = end + 1
    if pending is not None:
        raise ReadmeError(f"README.md:{pending.line}: a readme-test marker before no code block")
    return blocks


@dataclass(frozen=True, slots=True)
class Example:
    """A Python block and the transcripts replayed against the ``app`` it defines: those
    after it, before the next Python block."""

    code: Block
    transcripts: tuple[Block, ...] = ()


def read_examples(blocks: list[Block]) -> list[Example]:
    """Every Python block with its transcripts. A transcript with no Python block before it,
    or after a skipped one, and curl lines outside a transcript are errors: they would never
    be replayed."""
    examples: list[Example] = []
    for block in blocks:
        if block.marker is not None and not block.is_python:
            raise ReadmeError(
                f"README.md:{block.marker.line}: a readme-test marker before a "
                f"{block.language or 'plain'} block: only Python blocks are run"
            )
        if block.is_python:
            examples.append(Example(block))
        elif block.is_transcript:
            if not examples:
                raise ReadmeError(f"README.md:{block.line}: a transcript before any Python block")
            last = examples[-1]
            if last.code.marker is not None and last.code.marker.skip is not None:
                raise ReadmeError(
                    f"README.md:{block.line}: a transcript after a skipped block is never replayed"
                )
            examples[-1] = Example(last.code, (*last.transcripts, block))
        elif any(line.lstrip().startswith("curl ") for line in block.source.splitlines()):
            raise ReadmeError(
                f"README.md:{block.line}: write curl lines as a transcript (`$ curl ...` and the "
                "response it gets), so the README test replays them"
            )
    return examples


def _dedent(line: str, indent: int) -> str:
    """``line`` without the fence's indentation (CommonMark removes up to that much)."""
    stripped = len(line) - len(line.lstrip(" "))
    return line[min(indent, stripped) :]


@dataclass(frozen=True, slots=True)
class CurlRequest:
    """What a curl command line sends."""

    method: str
    url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes | None


@dataclass(frozen=True, slots=True)
class ShownResponse:
    """What a transcript shows after a command: the status line, the headers it chose to show
    (a subset of those sent), and the body, when it shows one."""

    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    body: str | None


@dataclass(frozen=True, slots=True)
class Exchange:
    """One ``$ curl`` command of a transcript, on README line ``line``, and what it shows."""

    line: int
    command: str
    request: CurlRequest
    response: ShownResponse


_STATUS_LINE = re.compile(r"HTTP/[0-9.]+ (?P<status>[1-5][0-9]{2})(?: (?P<reason>.*))?")
_HEADER_LINE = re.compile(r"(?P<name>[!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(?P<value>.*)")
_FLAGS = frozenset({"--silent", "--include", "--show-error"})
_SHORT_FLAGS = re.compile(r"-[siS]+")
_DATA = frozenset({"-d", "--data", "--data-raw", "--data-binary", "--data-ascii"})


def read_transcript(block: Block) -> list[Exchange]:
    """The curl exchanges of a transcript block; any other command is an error."""
    exchanges: list[Exchange] = []
    lines = block.source.splitlines()
    index = 0
    while index < len(lines):
        number = block.line + 1 + index
        if not lines[index].startswith(PROMPT):
            raise ReadmeError(f"README.md:{number}: output with no `$ ` command before it")
        command = lines[index].removeprefix(PROMPT)
        while command.endswith("\\") and index + 1 < len(lines):
            index += 1
            command = command[:-1].rstrip() + " " + lines[index].strip()
        index += 1
        output: list[str] = []
        while index < len(lines) and not lines[index].startswith(PROMPT):
            output.append(lines[index])
            index += 1
        try:
            exchanges.append(Exchange(number, command, parse_curl(command), _shown(output)))
        except ReadmeError as exc:
            raise ReadmeError(f"README.md:{number}: {exc}") from None
    return exchanges


def _shown(output: list[str]) -> ShownResponse:
    status = _STATUS_LINE.fullmatch(output[0]) if output else None
    if status is None:
        raise ReadmeError("show the response's status line (curl -si) after the command")
    headers: list[tuple[str, str]] = []
    rest = output[1:]
    while rest and (header := _HEADER_LINE.fullmatch(rest[0])):
        headers.append((header["name"], header["value"].strip()))
        rest = rest[1:]
    body = "\n".join(rest).strip()
    return ShownResponse(
        int(status["status"]), (status["reason"] or "").strip(), tuple(headers), body or None
    )


def parse_curl(command: str) -> CurlRequest:
    """The request ``command`` sends, as curl sends it: ``-d`` makes a POST with
    ``Content-Type: application/x-www-form-urlencoded`` unless a header names another type,
    ``--json`` one with ``application/json``; a URL without a scheme is ``http://``.

    Options it does not know are an error, so a transcript never means more than is checked.
    """
    tokens = shlex.split(command)
    if not tokens or tokens[0] != "curl":
        raise ReadmeError(f"only curl commands can be replayed, not {command!r}")
    method: str | None = None
    url: str | None = None
    headers: list[tuple[str, str]] = []
    data: list[str] = []
    json_data: list[str] = []
    arguments = iter(tokens[1:])

    def value(option: str) -> str:
        found = next(arguments, None)
        if found is None:
            raise ReadmeError(f"curl option {option} needs a value")
        return found

    for token in arguments:
        if token in ("-X", "--request"):
            method = value(token).upper()
        elif token in ("-H", "--header"):
            name, colon, header_value = value(token).partition(":")
            if not colon:
                raise ReadmeError(f"curl header {name!r} has no ':'")
            headers.append((name.strip(), header_value.strip()))
        elif token in _DATA:
            item = value(token)
            if item.startswith("@") and token != "--data-raw":
                raise ReadmeError("curl data from a file (@name) cannot be replayed")
            data.append(item)
        elif token == "--json":
            json_data.append(value(token))
        elif token in _FLAGS or _SHORT_FLAGS.fullmatch(token):
            continue  # output only: silent, include headers, show errors
        elif token.startswith("-"):
            raise ReadmeError(f"curl option {token} is not one the README test can replay")
        elif url is None:
            url = token
        else:
            raise ReadmeError(f"curl command with two URLs: {url!r} and {token!r}")
    if url is None:
        raise ReadmeError("curl command without a URL")
    if data and json_data:
        raise ReadmeError("curl command with both -d and --json")
    names = {name.lower() for name, _ in headers}
    body: bytes | None = None
    if json_data:
        body = "".join(json_data).encode()
        for name, default in (("Content-Type", "application/json"), ("Accept", "application/json")):
            if name.lower() not in names:
                headers.append((name, default))
    elif data:
        body = "&".join(data).encode()
        if "content-type" not in names:
            headers.append(("Content-Type", "application/x-www-form-urlencoded"))
    return CurlRequest(
        method=method or ("POST" if body is not None else "GET"),
        url=url if "://" in url else f"http://{url}",
        headers=tuple(headers),
        body=body,
    )
