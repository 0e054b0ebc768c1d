"""The idempotency record and its wire form (standard library and orjson only).

A record is plain data: the store keeps it, the middleware decides what it means. Its wire
form, written by every store that keeps JSON, is flat and camelCase::

    {"key": "8e03...", "status": "Completed", "requestFingerprint": "sha256:9f86...",
     "fingerprintVersion": "1", "responseStatusCode": 201, "responseBody": "{...}",
     "responseBodyEncoding": "utf-8", "responseHeaders": [["content-type", "application/json"]],
     "responseContentType": "application/json", "createdAt": "2026-11-30T10:00:00.000Z",
     "expiresAt": "2026-12-02T10:00:00.000Z", "ownerToken": "c1b0..."}
"""

from __future__ import annotations

import base64
import binascii
import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson


class RecordStatus(enum.StrEnum):
    """The three states of an idempotency key."""

    IN_PROGRESS = "InProgress"
    COMPLETED = "Completed"
    FAILED = "Failed"


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The response of a finished request, as it is replayed."""

    status_code: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    content_type: str | None = None

    def header(self, name: str) -> str | None:
        """The first stored header called ``name`` (lower case), if any."""
        for key, value in self.headers:  # a loop: every replay asks, a generator costs more
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A recovery point a handler recorded while it ran (see ``checkpoint``)."""

    name: str
    data: Any
    at: float


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    """One idempotency key's state. Times are seconds since the epoch (UTC).

    ``expires_at`` is the lock's end while the record is ``InProgress`` and the end of the
    retention time once it is ``Completed`` or ``Failed``. From its first checkpoint on, an
    ``InProgress`` record is kept for the retention time too, and its lease lives inside it as
    ``locked_until``: the store lets a retry take it over only once that has passed.
    """

    key: str
    status: RecordStatus
    request_fingerprint: str
    owner_token: str
    created_at: float
    expires_at: float
    fingerprint_version: str = "1"
    response: StoredResponse | None = None
    locked_until: float | None = None
    checkpoints: tuple[Checkpoint, ...] = ()

    # The design's flat names for the stored response (None while InProgress).
    @property
    def response_status_code(self) -> int | None:
        return self.response.status_code if self.response else None

    @property
    def response_body(self) -> bytes | None:
        return self.response.body if self.response else None

    @property
    def response_headers(self) -> tuple[tuple[str, str], ...] | None:
        return self.response.headers if self.response else None

    @property
    def response_content_type(self) -> str | None:
        return self.response.content_type if self.response else None

    def lease_expired(self, now: float) -> bool:
        """True for an ``InProgress`` record with checkpoints whose lease has run out."""
        return (
            self.status is RecordStatus.IN_PROGRESS
            and self.locked_until is not None
            and now >= self.locked_until
        )

    def finished(
        self, status: RecordStatus, response: StoredResponse, expires_at: float
    ) -> IdempotencyRecord:
        """This record moved to a final state with its response (and no lease any more)."""
        # Built directly: dataclasses.replace costs more than the rest of this on the hot path.
        return IdempotencyRecord(
            key=self.key,
            status=status,
            request_fingerprint=self.request_fingerprint,
            owner_token=self.owner_token,
            created_at=self.created_at,
            expires_at=expires_at,
            fingerprint_version=self.fingerprint_version,
            response=response,
            checkpoints=self.checkpoints,
        )


# Every request formats and parses a few times within the same few seconds: the date and
# time of day are remembered per whole second, and only the milliseconds are worked out.
_MAX_REMEMBERED_SECONDS = 256
_PARSED_SECONDS: dict[str, int] = {}


class _FormattedSeconds(dict[int, str]):
    """The date and time of day of each whole second (``2026-11-30T10:00:00``): looking up one
    already seen is the dict's own work, with no call of ours."""

    def __missing__(self, second: int) -> str:
        if len(self) >= _MAX_REMEMBERED_SECONDS:
            self.clear()
        formatted = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        self[second] = formatted
        return formatted


_SECONDS = _FormattedSeconds()


def _format_time(epoch: float) -> str:
    """``2026-11-30T10:00:00.123Z``: ISO 8601 in UTC, to the millisecond (truncated, once
    rounded to the microsecond). :func:`dump_record` writes its two times the same way."""
    millis = round(epoch * 1_000_000) // 1000
    return f"{_SECONDS[millis // 1000]}.{millis % 1000:03d}Z"


def _parse_time(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time; what :func:`_format_time` wrote is read
    without ``datetime`` once its second has been seen."""
    if len(text) == 24 and text[19] == "." and text[23] == "Z" and text[20:23].isdigit():
        second = _PARSED_SECONDS.get(text[:19])
        if second is None:
            second = round(datetime.fromisoformat(text[:19] + "+00:00").timestamp())
            if len(_PARSED_SECONDS) >= _MAX_REMEMBERED_SECONDS:
                _PARSED_SECONDS.clear()
            _PARSED_SECONDS[text[:19]] = second
        return second + int(text[20:23]) / 1000
    return datetime.fromisoformat(text).timestamp()


def dump_record(record: IdempotencyRecord) -> bytes:
    """The record's wire form as JSON bytes."""
    response = record.response
    body: str | None = None
    encoding: str | None = None
    if response is not None:
        try:
            body, encoding = response.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            body, encoding = base64.b64encode(response.body).decode("ascii"), "base64"
    # Formatted as _format_time formats, here: a call per time would be most of a dump's.
    created = round(record.created_at * 1_000_000) // 1000
    expires = round(record.expires_at * 1_000_000) // 1000
    wire: dict[str, Any] = {
        "key": record.key,
        "status": record.status,  # orjson writes an enum member as its value
        "requestFingerprint": record.request_fingerprint,
        "fingerprintVersion": record.fingerprint_version,
        "responseStatusCode": response.status_code if response else None,
        "responseBody": body,
        "responseBodyEncoding": encoding,
        "responseHeaders": response.headers if response else None,  # pairs as arrays
        "responseContentType": response.content_type if response else None,
        "createdAt": f"{_SECONDS[created // 1000]}.{created % 1000:03d}Z",
        "expiresAt": f"{_SECONDS[expires // 1000]}.{expires % 1000:03d}Z",
        "ownerToken": record.owner_token,
    }
    if record.locked_until is not None or record.checkpoints:
        # Only records with recovery points carry these. Stores' scripts rely on the order:
        # ownerToken, then lockedUntil (integer epoch milliseconds), then checkpoints, which
        # hold the user's own data.
        wire["lockedUntil"] = (
            None if record.locked_until is None else round(record.locked_until * 1000)
        )
        wire["checkpoints"] = checkpoints_to_wire(record.checkpoints)
    return orjson.dumps(wire)


def record_to_dict(record: IdempotencyRecord) -> dict[str, Any]:
    """The record's wire form as a dict (what :func:`dump_record` writes, as JSON reads it)."""
    wire: dict[str, Any] = orjson.loads(dump_record(record))
    return wire


def checkpoints_to_wire(checkpoints: tuple[Checkpoint, ...]) -> list[dict[str, Any]]:
    """Recovery points as JSON-ready dicts."""
    return [
        {"name": point.name, "data": point.data, "at": _format_time(point.at)}
        for point in checkpoints
    ]


def checkpoints_from_wire(points: list[dict[str, Any]]) -> tuple[Checkpoint, ...]:
    """Parse what :func:`checkpoints_to_wire` wrote."""
    return tuple(Checkpoint(p["name"], p.get("data"), _parse_time(p["at"])) for p in points)


_STATUSES = {status.value: status for status in RecordStatus}


def record_from_dict(data: dict[str, Any]) -> IdempotencyRecord:
    """Parse a record's wire form; raises ``ValueError`` on a malformed one."""
    # Every replay parses one: the dataclasses are built with positional arguments (keywords
    # cost a frozen dataclass's __init__ a third more), in their fields' order.
    get = data.get
    try:
        response = None
        if (status_code := get("responseStatusCode")) is not None:
            raw_body = get("responseBody") or ""
            if get("responseBodyEncoding") == "base64":
                body = base64.b64decode(raw_body, validate=True)
            else:
                body = raw_body.encode("utf-8")
            headers = []
            for name, value in get("responseHeaders") or ():
                headers.append((str(name), str(value)))
            response = StoredResponse(
                int(status_code), tuple(headers), body, get("responseContentType")
            )
        locked_until = get("lockedUntil")
        points = get("checkpoints")
        return IdempotencyRecord(
            data["key"],
            _STATUSES[data["status"]],
            data["requestFingerprint"],
            data["ownerToken"],
            _parse_time(data["createdAt"]),
            _parse_time(data["expiresAt"]),
            str(get("fingerprintVersion", "1")),
            response,
            None if locked_until is None else int(locked_until) / 1000,
            checkpoints_from_wire(points) if points else (),
        )
    except (KeyError, TypeError, binascii.Error) as exc:
        raise ValueError(f"malformed idempotency record: {exc!r}") from exc


def load_record(raw: bytes | str) -> IdempotencyRecord:
    """Parse JSON bytes written by :func:`dump_record`; raises ``ValueError`` when malformed."""
    data = orjson.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("malformed idempotency record: not a JSON object")
    return record_from_dict(data)
