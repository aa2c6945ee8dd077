"""Every HTTP request leaves one access-log line: this middleware writes it for the requests
that made no generation timeline (a timeline writes its own when it finishes). A WebSocket
connection leaves one line too, when it ends: `GET` with status 101 if it was accepted (each
generation it carried writes its own line as well), else the status its handshake was refused
with (403 when the server closed it before accepting).

An unknown path or method is logged with the path as sent, redacted and truncated, and
counted in `sluice_unmatched_requests_total{method, status}`; a request a route matched is
logged with the route's template (`/v1/files/{id}`), so no line carries an id or a secret.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.core.errors import outcome_of
from server.http.edge import request_id_from
from server.observability.access_log import HttpRecord, end_trace, log_http, trace_request
from server.observability.metrics import HTTP_METHODS, UNMATCHED_STATUSES, Metrics
from server.observability.redaction import redact
from server.observability.tracing import TraceParent

MAX_PATH_CHARS = 200


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival = time.monotonic()
        status = 500  # an exception with no response sent: the server's error middleware's

        def noting_status(message: Message) -> Awaitable[None]:
            # A plain function handing back `send`'s awaitable: no coroutine per token sent.
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            return send(message)

        trace, token = trace_request()
        try:
            await self.app(scope, receive, noting_status)
        finally:
            end_trace(token)
            if not trace.claimed:
                self._log(scope, status, time.monotonic() - arrival)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        status = 500  # an exception before the handshake was answered: the server's 500

        def noting_status(message: Message) -> Awaitable[None]:
            nonlocal status
            kind = message["type"]
            if kind == "websocket.accept":
                status = 101
            elif kind == "websocket.http.response.start":  # a refusal with a body
                status = message["status"]
            elif kind == "websocket.close" and status == 500:  # closed before it was accepted
                status = 403
            return send(message)

        try:
            await self.app(scope, receive, noting_status)
        finally:
            self._log(scope, status, time.monotonic() - arrival)

    def _log(self, scope: Scope, status: int, duration: float) -> None:
        route: Any = scope.get("route")
        method = str(scope.get("method", "GET"))  # (a WebSocket's handshake is a GET)
        if route is None or status == 405:
            if str(status) in UNMATCHED_STATUSES:
                label = method if method in HTTP_METHODS else "other"
                self.metrics.unmatched_requests.labels(label, str(status)).inc()
        path = getattr(route, "path", None) or _shown(scope["path"])
        header = _header(scope, b"x-request-id")
        trace = TraceParent.of(_header(scope, b"traceparent"), _header(scope, b"tracestate"))
        log_http(
            HttpRecord(
                request_id=header if header and request_id_from(header) == header else None,
                method=_shown(method)[:16],
                path=path,
                outcome=outcome_of(status),
                status=status,
                duration_s=duration,
                trace_id=None if trace is None else trace.trace_id,
            )
        )


def _shown(text: str) -> str:
    """`text` as a log line may show it: secrets redacted, at most MAX_PATH_CHARS."""
    clean = redact(text)
    return clean if len(clean) <= MAX_PATH_CHARS else clean[: MAX_PATH_CHARS - 1] + "…"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None
