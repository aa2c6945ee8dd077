"""Structured access log: one JSON object per finished request, on the `sluice.access` logger.

A generation's timeline builds an `AccessRecord` when its request ends, by any path, and calls
`log_request`. Every other HTTP request (an unknown route, a refused key on /v1/models,
/tokenize, the Batch API, ...) is written as an `HttpRecord` by the API's access-log middleware,
which skips the requests that made a timeline: each request leaves exactly one line.
Field names and units are documented in docs/observability.md ("Access log").
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from asyncio import Task, current_task
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any, Literal

ACCESS_LOGGER_NAME = "sluice.access"

logger = logging.getLogger(ACCESS_LOGGER_NAME)

Api = Literal["chat", "completions", "ws", "responses", "messages"]


@dataclass(frozen=True, slots=True)
class AccessRecord:
    """What one request did. Times are seconds; a time the request never reached is None."""

    request_id: str
    tenant: str
    traffic_class: str
    model: str
    outcome: str
    status: int
    ttft_s: float | None
    median_itl_s: float | None
    duration_s: float
    prompt_tokens: int
    generated_tokens: int
    api: Api
    preemptions: int = 0  # times the scheduler stopped it for a chat and resumed it
    cached_tokens: int | None = None  # prompt tokens found in the engine's prefix cache
    trace_id: str | None = None  # its span's trace (hex), or the traceparent's it came with

    def to_json(self, now: datetime | None = None) -> str:
        when = now if now is not None else datetime.now(UTC)
        fields: dict[str, Any] = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id,
            "tenant": self.tenant,
            "class": self.traffic_class,
            "model": self.model,
            "api": self.api,
            "outcome": self.outcome,
            "status": self.status,
            "ttft_s": _seconds(self.ttft_s),
            "median_itl_s": _seconds(self.median_itl_s),
            "duration_s": _seconds(self.duration_s),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.preemptions,
            "cached_tokens": self.cached_tokens,
            "trace_id": self.trace_id,
        }
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True, slots=True)
class HttpRecord:
    """An HTTP request that made no generation timeline. `path`: the route's template where
    one matched, else the path as sent (redacted and truncated by the middleware)."""

    request_id: str | None
    method: str
    path: str
    outcome: str
    status: int
    duration_s: float
    trace_id: str | None = None  # the traceparent's it came with

    def to_json(self, now: datetime | None = None) -> str:
        when = now if now is not None else datetime.now(UTC)
        fields: dict[str, Any] = {
            "ts": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id,
            "api": "http",
            "method": self.method,
            "path": self.path,
            "outcome": self.outcome,
            "status": self.status,
            "duration_s": _seconds(self.duration_s),
            "trace_id": self.trace_id,
        }
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


class RequestTrace:
    """Whether the HTTP request being served will be logged by a generation timeline: set by
    the middleware for the request's task, claimed by a timeline made in that task."""

    __slots__ = ("claimed", "task")

    def __init__(self, task: Task[Any] | None) -> None:
        self.task = task
        self.claimed = False


_trace: ContextVar[RequestTrace | None] = ContextVar("sluice_request_trace", default=None)


def trace_request() -> tuple[RequestTrace, Any]:
    """A trace for the request the current task serves, and the token that ends it
    (`end_trace`)."""
    trace = RequestTrace(current_task())
    return trace, _trace.set(trace)


def end_trace(token: Any) -> None:
    _trace.reset(token)


def claim_access_line() -> None:
    """A timeline was made for the request this task serves: its `finish` writes the line.
    (Tasks the request started, e.g. a Batch API run, inherit the trace but claim nothing.)"""
    trace = _trace.get()
    if trace is not None and trace.task is current_task():
        trace.claimed = True


def release_access_line() -> None:
    """The timeline this task made will not finish (an idempotent replay answers with an
    earlier request's run): the middleware writes the request's line after all."""
    trace = _trace.get()
    if trace is not None and trace.task is current_task():
        trace.claimed = False


def _seconds(value: float | None) -> float | None:
    # Microsecond resolution is finer than any clock Sluice reads; NaN/inf are not JSON.
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return round(value, 6)


def median(values: Iterable[float]) -> float | None:
    """The median of `values`, or None when there are none (a request with < 2 tokens)."""
    collected = list(values)
    if not collected:
        return None
    return float(statistics.median(collected))


def log_request(record: AccessRecord) -> None:
    """Write `record` as one JSON line at INFO on the `sluice.access` logger."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(record.to_json())


def log_http(record: HttpRecord) -> None:
    """Write `record` as one JSON line at INFO on the `sluice.access` logger."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(record.to_json())


def install_handler(stream: IO[str] | None = None) -> logging.Handler:
    """Send access lines, bare (no level or logger prefix), to `stream` (default stdout).

    Idempotent: a second call replaces the handler the first installed. The access logger
    stops propagating so the lines are not repeated by the root logger's handlers.
    """
    for existing in list(logger.handlers):
        if getattr(existing, "_sluice_access", False):
            logger.removeHandler(existing)
    handler = logging.StreamHandler(stream if stream is not None else sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._sluice_access = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler
