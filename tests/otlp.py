"""An OTLP/HTTP receiver for the tests: what a collector would receive (no collector can be
installed here). A stdlib HTTP server on loopback decodes each `POST /v1/traces` with
OpenTelemetry's own protobuf messages (`opentelemetry-proto`); `Parent` is a W3C trace context
as a caller (vLLM's router, say) sends it."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from conftest import wait_until
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_WAIT_S = 30.0


@dataclass
class ReceivedSpan:
    """A span as the receiver decoded it: ids in hex, attributes as Python values."""

    trace_id: str
    span_id: str
    parent_span_id: str
    trace_state: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    status: int
    status_message: str
    service: str

    @property
    def event_names(self) -> list[str]:
        return [name for name, _, _ in self.events]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decoded(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """An export request's spans."""
    spans = []
    for resource_spans in request.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            spans.extend(
                ReceivedSpan(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    trace_state=span.trace_state,
                    name=span.name,
                    kind=span.kind,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    attributes=_attributes(span.attributes),
                    events=[
                        (e.name, e.time_unix_nano, _attributes(e.attributes)) for e in span.events
                    ],
                    status=span.status.code,
                    status_message=span.status.message,
                    service=service,
                )
                for span in scope_spans.spans
            )
    return spans


@dataclass
class OtlpReceiver:
    """An OTLP/HTTP receiver on loopback: what a collector would receive."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: list[str] = field(default_factory=list)  # each request's content type

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append(self.headers.get("Content-Type", ""))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        self.spans.extend(decoded(request))

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in list(self.spans) if span.trace_id == trace_id]

    def wait_for(self, trace_id: str, count: int = 1) -> list[ReceivedSpan]:
        """The trace's spans, once `count` of them have arrived."""
        wait_until(
            lambda: len(self.in_trace(trace_id)) >= count,
            SPAN_WAIT_S,
            message=f"{count} span(s) of trace {trace_id}",
        )
        return self.in_trace(trace_id)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Parent:
    """A W3C trace context as a caller (vLLM's router, say) would send it."""

    trace_id: str = field(default_factory=lambda: secrets.token_hex(16))
    span_id: str = field(default_factory=lambda: secrets.token_hex(8))
    sampled: bool = True

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"

    def headers(self, **more: str) -> dict[str, str]:
        return {"traceparent": self.traceparent, "tracestate": "router=r1", **more}
