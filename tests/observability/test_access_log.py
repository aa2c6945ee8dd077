from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from server.observability.access_log import (
    ACCESS_LOGGER_NAME,
    AccessRecord,
    HttpRecord,
    claim_access_line,
    end_trace,
    install_handler,
    log_request,
    median,
    release_access_line,
    trace_request,
)


@pytest.fixture(autouse=True)
def _access_logger_restored() -> Iterator[None]:
    """Each test leaves the access logger as it found it: `install_handler` stops it
    propagating, and in-process servers' tests in this worker read its lines through the root
    logger."""
    access_logger = logging.getLogger(ACCESS_LOGGER_NAME)
    handlers, level = list(access_logger.handlers), access_logger.level
    propagate = access_logger.propagate
    yield
    access_logger.handlers[:] = handlers
    access_logger.setLevel(level)
    access_logger.propagate = propagate


def _record(**overrides: object) -> AccessRecord:
    fields: dict[str, object] = {
        "request_id": "chatcmpl-1",
        "tenant": "acme",
        "traffic_class": "interactive",
        "model": "sluice-demo",
        "outcome": "completed",
        "status": 200,
        "ttft_s": 0.0123456789,
        "median_itl_s": 0.004,
        "duration_s": 1.5,
        "prompt_tokens": 12,
        "generated_tokens": 34,
        "api": "chat",
    }
    fields.update(overrides)
    return AccessRecord(**fields)  # type: ignore[arg-type]


def test_record_renders_every_field_as_one_json_object() -> None:
    line = _record().to_json(now=datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=UTC))
    assert "\n" not in line
    assert json.loads(line) == {
        "ts": "2025-01-02T03:04:05.678Z",
        "request_id": "chatcmpl-1",
        "tenant": "acme",
        "class": "interactive",
        "model": "sluice-demo",
        "api": "chat",
        "outcome": "completed",
        "status": 200,
        "ttft_s": 0.012346,
        "median_itl_s": 0.004,
        "duration_s": 1.5,
        "prompt_tokens": 12,
        "generated_tokens": 34,
        "preemptions": 0,
        "cached_tokens": None,
        "trace_id": None,
    }


def test_times_never_reached_are_null_and_non_finite_times_do_not_break_json() -> None:
    line = _record(
        outcome="rejected",
        status=503,
        ttft_s=None,
        median_itl_s=float("nan"),
        duration_s=float("inf"),
        generated_tokens=0,
    ).to_json()
    body = json.loads(line)
    assert body["ttft_s"] is None
    assert body["median_itl_s"] is None
    assert body["duration_s"] is None


def test_log_request_writes_one_bare_json_line_to_the_access_logger() -> None:
    stream = io.StringIO()
    handler = install_handler(stream)
    try:
        log_request(_record(request_id="a"))
        log_request(_record(request_id='b\n"quoted"', api="ws"))
    finally:
        logging.getLogger(ACCESS_LOGGER_NAME).removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["a", 'b\n"quoted"']
    assert json.loads(lines[1])["api"] == "ws"


def test_install_handler_is_idempotent_and_stops_propagation() -> None:
    first, second = io.StringIO(), io.StringIO()
    install_handler(first)
    handler = install_handler(second)
    access_logger = logging.getLogger(ACCESS_LOGGER_NAME)
    try:
        log_request(_record())
        assert first.getvalue() == ""
        assert len(second.getvalue().splitlines()) == 1
        assert access_logger.propagate is False
    finally:
        access_logger.removeHandler(handler)


def test_nothing_is_written_when_the_access_logger_is_silenced() -> None:
    stream = io.StringIO()
    handler = install_handler(stream)
    access_logger = logging.getLogger(ACCESS_LOGGER_NAME)
    access_logger.setLevel(logging.WARNING)
    try:
        log_request(_record())
    finally:
        access_logger.removeHandler(handler)
        access_logger.setLevel(logging.INFO)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], None), ([0.5], 0.5), ([0.3, 0.1, 0.2], 0.2), ([0.1, 0.2, 0.3, 0.4], 0.25)],
)
def test_median(values: list[float], expected: float | None) -> None:
    assert median(values) == (pytest.approx(expected) if expected is not None else None)


def test_an_http_record_names_method_path_status_and_duration() -> None:
    record = HttpRecord(None, "POST", "/v1/responses", "invalid", 404, 0.0012345678)
    body = json.loads(record.to_json(datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)))
    assert body == {
        "ts": "2025-01-02T03:04:05.678Z",
        "request_id": None,
        "api": "http",
        "method": "POST",
        "path": "/v1/responses",
        "outcome": "invalid",
        "status": 404,
        "duration_s": 0.001235,
        "trace_id": None,
    }


async def test_only_the_requests_own_task_claims_its_line() -> None:
    claim_access_line()  # outside any request: nothing to claim, no error
    trace, token = trace_request()
    try:
        await asyncio.create_task(_claim())  # a task the request started (a Batch API run)
        assert not trace.claimed
        claim_access_line()
        assert trace.claimed
        release_access_line()  # its timeline went unused: the middleware's line after all
        assert not trace.claimed
    finally:
        end_trace(token)


async def _claim() -> None:
    claim_access_line()
