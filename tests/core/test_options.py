from __future__ import annotations

import pytest
from starlette.applications import Starlette

import starlette_idempotency
from starlette_idempotency import ConfigurationError, IdempotencyMiddleware, MemoryStore, idempotent


@pytest.mark.parametrize(
    "options",
    [
        {"ttl_hours": 0},
        {"lock_ttl_seconds": -1},
        {"on_store_error": "maybe"},
        {"exclude_fields": "amount"},
    ],
)
def test_invalid_decorator_options_fail_at_import_time(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        idempotent(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"max_key_length": 0},
        {"store_timeout_seconds": 0},
        {"lock_ttl_seconds": 0},
        {"error_format": "xml"},
    ],
)
def test_invalid_middleware_options(options: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"."):
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), **options)  # type: ignore[arg-type]


def test_fractional_durations_are_accepted() -> None:
    idempotent(ttl_hours=0.5, lock_ttl_seconds=0.25)


def test_exported_members() -> None:
    assert starlette_idempotency.__all__ == sorted(starlette_idempotency.__all__)
    for name in starlette_idempotency.__all__:
        assert getattr(starlette_idempotency, name) is not None


def test_record_offers_the_designs_flat_response_fields() -> None:
    from starlette_idempotency import IdempotencyRecord, RecordStatus, StoredResponse

    pending = IdempotencyRecord("k", RecordStatus.IN_PROGRESS, "sha256:x", "owner", 1.0, 2.0)
    assert pending.response_status_code is None
    assert pending.response_body is None
    done = pending.finished(
        RecordStatus.COMPLETED,
        StoredResponse(201, (("content-type", "application/json"),), b"{}", "application/json"),
        expires_at=3.0,
    )
    assert done.status == "Completed"
    assert done.response_status_code == 201
    assert done.response_body == b"{}"
    assert done.response_headers == (("content-type", "application/json"),)
    assert done.response_content_type == "application/json"
