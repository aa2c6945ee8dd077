"""OpenTelemetry traces: one span per generation, named and attributed as vLLM's server does
(`llm_request`, kind SERVER, the `gen_ai.*` attributes), with the scheduler's decisions on it as
events and Sluice's own attributes beside vLLM's.

Off unless `tracing.otlp_traces_endpoint` (`--otlp-traces-endpoint`) is set. Then the app holds
a `Tracing`: a `TracerProvider` of its own (not the process's global one, so two apps of one
process export apart), a `BatchSpanProcessor` and an OTLP exporter, gRPC or HTTP/protobuf by
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (grpc by default, as vLLM's). The SDK reads the other
`OTEL_*` variables itself: `OTEL_SERVICE_NAME` (default here: `sluice`), `OTEL_TRACES_SAMPLER`,
`OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, `..._TIMEOUT`, `..._COMPRESSION`, ...

A span is made when its request ends, in one call, from what its timeline recorded (times on
the shell's monotonic clock, turned into the epoch with one offset per span): nothing is done
per token, and with tracing off nothing at all. Its parent is the W3C `traceparent` (and
`tracestate`) the request came with (`TraceParent`, read at the edge). docs/observability.md
("Traces") lists what a span holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, format_trace_id, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SPAN_NAME: Final = "llm_request"  # vLLM's
SERVICE: Final = "sluice"  # the service's name unless OTEL_SERVICE_NAME (or the resource) names one
PROTOCOLS: Final = ("grpc", "http/protobuf")
# The standard variables that choose the exporter (the SDK leaves that to its caller); the first
# set wins, as the OTLP specification has it.
PROTOCOL_VARIABLES: Final = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
MAX_TRACEPARENT_CHARS: Final = 256  # a valid one has 55; a longer one is not read
MAX_TRACESTATE_CHARS: Final = 512  # W3C: a vendor may drop a longer one

_PROPAGATOR: Final = TraceContextTextMapPropagator()


class VllmAttributes:
    """vLLM's span attributes (`vllm/tracing/utils.py`, `SpanAttributes`): times in seconds."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


class SluiceAttributes:
    """Sluice's own span and event attributes."""

    API = "sluice.api"
    TENANT = "sluice.tenant"
    TRAFFIC_CLASS = "sluice.traffic_class"
    GENERATION_ID = "sluice.generation_id"  # what resumes it (its public id), once it ran
    OUTCOME = "sluice.outcome"
    STATUS = "sluice.status"  # the HTTP status it was answered with (a stream's: 200)
    CACHED_TOKENS = "sluice.usage.cached_tokens"
    PREEMPTIONS = "sluice.preemptions"
    MEDIAN_ITL = "sluice.latency.median_itl"
    SLO_RESULT = "sluice.slo.result"  # met | missed (absent: the request is not judged)
    SLO_REASON = "sluice.slo.reason"  # none | ttft | itl | expired | failed | refused
    ERROR_TYPE = "error.type"  # OpenTelemetry's: the error's code


@dataclass(frozen=True, slots=True)
class TraceParent:
    """The W3C trace context a request came with, as sent: read at the edge, parsed (by
    OpenTelemetry's propagator) only when its request ends."""

    traceparent: str
    tracestate: str | None = None

    @staticmethod
    def of(traceparent: object, tracestate: object = None) -> TraceParent | None:
        """From the values sent (a header's, a message field's); None for none, or for one no
        traceparent could be (not a string, or far too long)."""
        if not isinstance(traceparent, str) or len(traceparent) > MAX_TRACEPARENT_CHARS:
            return None
        state = tracestate if isinstance(tracestate, str) else None
        if state is not None and len(state) > MAX_TRACESTATE_CHARS:
            state = None
        return TraceParent(traceparent, state)

    def carrier(self) -> dict[str, str]:
        """As headers: what the propagator reads."""
        if self.tracestate is None:
            return {"traceparent": self.traceparent}
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}

    def context(self) -> Context:
        """The parent context (an empty one for a malformed traceparent: the span is a root)."""
        return _PROPAGATOR.extract(self.carrier(), Context())

    @property
    def trace_id(self) -> str | None:
        """Its trace id in hex (None: malformed)."""
        span_context = get_current_span(self.context()).get_span_context()
        return format_trace_id(span_context.trace_id) if span_context.is_valid else None


@dataclass(frozen=True, slots=True)
class GenerationSpan:
    """What one request's span is made of. Times are seconds on the shell's monotonic clock;
    one the request never reached is None."""

    request_id: str
    api: str
    model: str
    tenant: str
    traffic_class: str
    outcome: str
    status: int
    arrival: float
    ended: float
    parent: TraceParent | None = None
    queued: float | None = None  # admitted to the scheduler's queue
    dispatched: float | None = None  # left it for the engine
    first_token: float | None = None  # its first token written to the client
    last_token: float | None = None
    # Each time the scheduler stopped it for a chat: (when, when it was dispatched again; None:
    # never), in order.
    pauses: Sequence[tuple[float, float | None]] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    median_itl_s: float | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    generation_id: str | None = None
    slo: tuple[str, str] | None = None  # (result, reason), as sluice_slo_requests_total's
    error: str | None = None  # the error's code

    @property
    def failed(self) -> bool:
        """Whether it ended in an error of the server's (a client that left is not one)."""
        return self.error is not None and self.outcome != "cancelled"

    def attributes(self) -> dict[str, Any]:
        """vLLM's attributes, then Sluice's."""
        arrival, dispatched, first = self.arrival, self.dispatched, self.first_token
        values: dict[str, Any] = {
            VllmAttributes.REQUEST_ID: self.request_id,
            VllmAttributes.RESPONSE_MODEL: self.model,
            VllmAttributes.USAGE_PROMPT_TOKENS: self.prompt_tokens,
            VllmAttributes.USAGE_COMPLETION_TOKENS: self.completion_tokens,
            VllmAttributes.LATENCY_E2E: self.ended - arrival,
            SluiceAttributes.API: self.api,
            SluiceAttributes.TENANT: self.tenant,
            SluiceAttributes.TRAFFIC_CLASS: self.traffic_class,
            SluiceAttributes.OUTCOME: self.outcome,
            SluiceAttributes.STATUS: self.status,
            SluiceAttributes.PREEMPTIONS: len(self.pauses),
        }
        optional = {
            VllmAttributes.REQUEST_MAX_TOKENS: self.max_tokens,
            VllmAttributes.REQUEST_TEMPERATURE: self.temperature,
            VllmAttributes.REQUEST_TOP_P: self.top_p,
            VllmAttributes.REQUEST_N: self.n,
            SluiceAttributes.GENERATION_ID: self.generation_id,
            SluiceAttributes.CACHED_TOKENS: self.cached_tokens,
            SluiceAttributes.MEDIAN_ITL: self.median_itl_s,
            SluiceAttributes.ERROR_TYPE: self.error,
        }
        values.update((name, value) for name, value in optional.items() if value is not None)
        if dispatched is not None:
            values[VllmAttributes.LATENCY_TIME_IN_QUEUE] = dispatched - arrival
            values[VllmAttributes.LATENCY_TIME_IN_SCHEDULER] = self.time_in_scheduler()
        if first is not None:
            values[VllmAttributes.LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
            if dispatched is not None:
                values[VllmAttributes.LATENCY_TIME_IN_MODEL_PREFILL] = first - dispatched
                last = self.last_token if self.last_token is not None else first
                values[VllmAttributes.LATENCY_TIME_IN_MODEL_DECODE] = last - first
                values[VllmAttributes.LATENCY_TIME_IN_MODEL_INFERENCE] = last - dispatched
        if self.slo is not None:
            values[SluiceAttributes.SLO_RESULT], values[SluiceAttributes.SLO_REASON] = self.slo
        return values

    def time_in_scheduler(self) -> float:
        """Its waits in Sluice's queue: until dispatch, and from each preemption to its
        resumption (or to the end, for one that never resumed)."""
        assert self.dispatched is not None
        waited = self.dispatched - self.arrival
        for stopped, resumed in self.pauses:
            waited += (self.ended if resumed is None else resumed) - stopped
        return waited

    def events(self) -> list[tuple[str, float, dict[str, Any]]]:
        """The scheduler's decisions and the stream's milestones, in time order: (name, time,
        attributes)."""
        marks: list[tuple[str, float, dict[str, Any]]] = []
        if self.queued is not None:
            marks.append(("queued", self.queued, {}))
        if self.dispatched is not None:
            marks.append(("dispatched", self.dispatched, {}))
        for stopped, resumed in self.pauses:
            marks.append(("preempted", stopped, {}))
            if resumed is not None:
                marks.append(("resumed", resumed, {}))
        if self.first_token is not None:
            marks.append(("first_token", self.first_token, {}))
        marks.sort(key=lambda mark: mark[1])  # (stable: equal times keep the order above)
        # (Its status and error are the span's: each attribute costs the exporter ~2 µs.)
        marks.append(("end", self.ended, {SluiceAttributes.OUTCOME: self.outcome}))
        return marks


class Tracing:
    """An app's tracer: its provider (and, through it, its batch processor and exporter)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("sluice")

    def export(self, facts: GenerationSpan) -> str:
        """Make and end the request's span (the batch processor sends it later, off the
        loop); its trace id, in hex."""
        offset = time.time_ns() - time.monotonic_ns()  # the shell's clock into the epoch

        def ns(seconds: float) -> int:
            return int(seconds * 1e9) + offset

        parent = facts.parent.context() if facts.parent is not None else Context()
        span = self._tracer.start_span(
            SPAN_NAME,
            parent,
            SpanKind.SERVER,
            attributes=facts.attributes(),
            start_time=ns(facts.arrival),
        )
        if span.is_recording():
            for name, at, attributes in facts.events():
                span.add_event(name, attributes, ns(at))
            if facts.failed:
                span.set_status(Status(StatusCode.ERROR, facts.error))
        span.end(ns(facts.ended))
        return format_trace_id(span.get_span_context().trace_id)

    def shutdown(self) -> None:
        """Send what is waiting, then stop (blocking: run it off the event loop)."""
        self.provider.shutdown()


def build_tracing(endpoint: str | None, environ: Mapping[str, str]) -> Tracing | None:
    """The app's tracing, or None without an endpoint. ValueError: the protocol that
    `environ` asks for is not one Sluice exports with."""
    if endpoint is None:
        return None
    protocol = next((environ[v] for v in PROTOCOL_VARIABLES if environ.get(v)), "grpc")
    provider = TracerProvider(resource=_resource(), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_exporter(protocol.strip(), endpoint)))
    return Tracing(provider)


def _resource() -> Resource:
    """The SDK's resource (OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME), named `sluice` where
    neither names the service."""
    named = SERVICE_NAME in OTELResourceDetector().detect().attributes
    return Resource.create(None if named else {SERVICE_NAME: SERVICE})


def _exporter(protocol: str, endpoint: str) -> SpanExporter:
    """The OTLP exporter for `protocol`, as vLLM builds it: gRPC to `endpoint` without TLS
    unless its scheme is https; HTTP/protobuf to `endpoint` as given (a URL ending in
    /v1/traces)."""
    # Imported here, the one chosen: gRPC's exporter imports grpc (~0.1 s).
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(
        f"{PROTOCOL_VARIABLES[0]}={protocol!r} is not supported: {' or '.join(PROTOCOLS)}"
    )
