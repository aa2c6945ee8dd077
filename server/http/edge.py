"""The edge: what is read from a connection (headers, the peer, a disconnect) into typed
values, and what every transport is handed (the send watchdog, the ping interval, the body
limit). Past the edge nothing reads headers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from server.core.errors import InvalidRequest
from server.core.ids import own_id
from server.generations.planner import RequestContext
from server.http.send_guard import SendGuard
from server.http.sse import SSEResponse
from server.observability.tracing import TraceParent
from server.scheduler.types import TrafficClass

_REQUEST_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


@dataclass(frozen=True, slots=True)
class Edge:
    """What every transport needs besides the generations."""

    send_guard: SendGuard
    ping_seconds: float = 15.0
    max_body_bytes: int = 1 << 20
    # A stream's reader that finds several pieces of text waiting (it fell behind) sends them
    # as one chunk; off: one event per piece, whatever the backlog.
    coalesce: bool = True

    def sse(
        self,
        content: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        ping: Callable[[], bytes] | None = None,
    ) -> SSEResponse:
        """A stream of `content`'s SSE bytes, its sends watched, pinged every `ping_seconds`
        (with `ping`'s event, or a comment)."""
        return SSEResponse(
            content, self.send_guard, headers=headers, ping_seconds=self.ping_seconds, ping=ping
        )


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one."""
    if header and len(header) <= 128 and set(header) <= _REQUEST_ID_CHARS:
        return header
    return own_id()


def api_key_from(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def traffic_class_from(value: str | None) -> TrafficClass | None:
    """X-Traffic-Class, or None when absent."""
    if value is None or not value.strip():
        return None
    try:
        return TrafficClass(value.strip().lower())
    except ValueError:
        raise InvalidRequest(
            "X-Traffic-Class must be 'interactive' or 'bulk'", param="X-Traffic-Class"
        ) from None


def timeout_from(value: str | None) -> float | None:
    """X-Request-Timeout-Ms in seconds, or None when absent."""
    if value is None or not value.strip():
        return None
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = -1.0
    if not milliseconds > 0 or milliseconds == float("inf"):
        raise InvalidRequest(
            "X-Request-Timeout-Ms must be a positive number of milliseconds",
            param="X-Request-Timeout-Ms",
        )
    return milliseconds / 1000.0


def trace_parent_from(headers: Mapping[str, str]) -> TraceParent | None:
    """The W3C trace context sent (`traceparent`, `tracestate`), as sent: parsed only when the
    request ends, for its span or its access line."""
    traceparent = headers.get("traceparent")
    if traceparent is None:
        return None
    return TraceParent.of(traceparent, headers.get("tracestate"))


def context_from_headers(headers: Mapping[str, str], client: str | None = None) -> RequestContext:
    return RequestContext(
        api_key_from(headers),
        traffic_class_from(headers.get("x-traffic-class")),
        timeout_from(headers.get("x-request-timeout-ms")),
        client=client,
    )


def context_of(connection: HTTPConnection) -> RequestContext:
    """An HTTP request's or a WebSocket's."""
    return context_from_headers(connection.headers, client_address(connection))


def client_address(connection: HTTPConnection) -> str | None:
    return connection.client.host if connection.client is not None else None
