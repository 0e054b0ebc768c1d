"""Executions: runs counted by idempotency key, and assertion messages that say what ran."""

from __future__ import annotations

import re

import pytest
from starlette.requests import Request

from starlette_idempotency.testing import Executions


def request_with(headers: dict[str, str]) -> Request:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


def test_runs_are_counted_by_key() -> None:
    executions = Executions()
    executions.record("a")
    executions.record(request_with({"Idempotency-Key": "a"}))
    executions.record(request_with({"Idempotency-Key": "b"}))
    executions.record(request_with({}))
    assert (executions.count("a"), executions.count("b"), executions.count(None)) == (2, 1, 1)
    assert executions.count("never-sent") == 0
    assert executions.total == 4
    executions.assert_ran_once("b")
    executions.assert_ran_once(None)
    executions.assert_ran_times("a", 2)
    executions.assert_ran_times("never-sent", 0)


def test_another_header_name() -> None:
    executions = Executions(header_name="X-Request-Id")
    executions.record(request_with({"Idempotency-Key": "a", "X-Request-Id": "r1"}))
    executions.assert_ran_once("r1")
    executions.assert_ran_times("a", 0)


def test_a_second_run_fails_with_the_runs_by_key() -> None:
    executions = Executions()
    for key in ("k", "k", "other"):
        executions.record(key)
    expected = (
        "expected exactly one run of the handler for Idempotency-Key 'k', got 2 runs; "
        "runs by key: {'k': 2, 'other': 1}"
    )
    with pytest.raises(AssertionError, match=re.escape(expected)):
        executions.assert_ran_once("k")


def test_a_missing_run_fails() -> None:
    executions = Executions()
    with pytest.raises(
        AssertionError,
        match=re.escape("expected exactly one run of the handler without a key, got no run"),
    ):
        executions.assert_ran_once(None)
    executions.record("k")
    with pytest.raises(AssertionError, match=re.escape("expected no run of the handler for")):
        executions.assert_ran_times("k", 0)
    with pytest.raises(AssertionError, match=re.escape("expected 3 runs of the handler for")):
        executions.assert_ran_times("k", 3)
