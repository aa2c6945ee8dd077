"""OpenTelemetry traces (server/observability/tracing.py): a `traceparent` sent to any API comes
out in the span the server exports for that request, vLLM's `llm_request` with its `gen_ai.*`
attributes, Sluice's own, and the scheduler's decisions as events.

A real OTLP/HTTP receiver (`OtlpReceiver`: a stdlib HTTP server on loopback that decodes each
`POST /v1/traces` with OpenTelemetry's protobuf messages) and a real server in this process (the
sim engine, `--otlp-traces-endpoint` the receiver, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=
http/protobuf`); the official `openai` and `anthropic` clients, `httpx` and `websockets` send
the requests. The batch processor's delay is lowered (`OTEL_BSP_SCHEDULE_DELAY`) and the tests
poll until a span arrives.
"""

from __future__ import annotations

import asyncio
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import websockets
from conftest import AccessLines, HeldSteps, InProcessSluice, uncalibrated_config, wait_until
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from otlp import OtlpReceiver, Parent, ReceivedSpan, decoded

from server.api.serving import StartRefused, assemble
from server.cli import parse_serve
from server.observability.tracing import GenerationSpan, TraceParent, build_tracing

# `openai` (~0.5 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

# One worker runs the module (one receiver, one server), the worker that imports `anthropic`
# (~1.5 s) for its own tests: one of these sends an Anthropic request.
pytestmark = [pytest.mark.service, pytest.mark.xdist_group("anthropic")]

KEY, TENANT = "sk-traced", "acme"
THRIFTY_KEY = "sk-thrifty"  # a tenant whose quota refuses any request of more than 8 tokens
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
# One sequence at a time and no reserve: a chat sent while bulk runs stops it at once.
CONFIG = f"""
tenants:
  {TENANT}: {{api_keys: [{KEY}]}}
  thrifty: {{api_keys: [{THRIFTY_KEY}], tokens_per_minute: 8}}
budgets:
  max_running_seqs: 1
  interactive_reserve_share: 0.0
  bulk_min_share: 0.0
  preempt_bulk_after_ms: 0
slo:
  cap_bulk: false
"""


# -- the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


def _serve(root: Path, *args: str, env: dict[str, str] | None = None) -> InProcessSluice:
    """A sim-engine server in this process. The batch processor reads its delay from the
    process's environment when the app is assembled: lowered until the server is up."""
    config = uncalibrated_config(root, CONFIG)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        server = InProcessSluice(
            ["--engine", "sim", "--sim-step-base-ms", "5", "--config", str(config), *args],
            root / "server.log",
            env=env,
        )
        server.wait_ready(60)
    return server


@pytest.fixture(scope="module")
def traced(
    receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[InProcessSluice]:
    server = _serve(
        tmp_path_factory.mktemp("traced"),
        "--otlp-traces-endpoint",
        receiver.url,
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )
    try:
        yield server
    finally:
        server.stop()


def chat_client(server: InProcessSluice, key: str = KEY) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def assert_child_of(span: ReceivedSpan, parent: Parent) -> None:
    assert (span.trace_id, span.parent_span_id) == (parent.trace_id, parent.span_id)
    assert (span.name, span.kind) == ("llm_request", ProtoSpan.SPAN_KIND_SERVER)
    assert span.trace_state == "router=r1"


# -- one request's span ---------------------------------------------------------------------


def test_a_chat_s_span_is_the_traceparent_s_child_with_vllm_s_attributes_and_sluice_s(
    traced: InProcessSluice, receiver: OtlpReceiver, access_lines: AccessLines
) -> None:
    parent, request_id = Parent(), f"req-{uuid.uuid4().hex}"
    reply = chat_client(traced).chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        extra_headers=parent.headers(**{"X-Request-Id": request_id}),
    )
    assert reply.usage is not None
    [span] = receiver.wait_for(parent.trace_id)
    assert_child_of(span, parent)
    assert span.service == "sluice"
    values = span.attributes
    assert values["gen_ai.request.id"] == request_id
    assert values["gen_ai.response.model"] == "sim"
    assert values["gen_ai.request.max_tokens"] == 12
    assert values["gen_ai.request.temperature"] == 0.5
    assert values["gen_ai.request.top_p"] == 0.9
    assert values["gen_ai.request.n"] == 1
    assert values["gen_ai.usage.prompt_tokens"] == reply.usage.prompt_tokens
    assert values["gen_ai.usage.completion_tokens"] == reply.usage.completion_tokens == 12
    latency = {k.removeprefix("gen_ai.latency."): v for k, v in values.items() if "latency" in k}
    # In seconds, as vLLM's: each stage within the whole.
    assert 0 <= latency["time_in_queue"] <= latency["time_to_first_token"] <= latency["e2e"]
    assert latency["time_in_scheduler"] == latency["time_in_queue"]  # never preempted
    assert latency["time_in_model_inference"] == pytest.approx(
        latency["time_in_model_prefill"] + latency["time_in_model_decode"]
    )
    assert span.end_ns - span.start_ns == pytest.approx(latency["e2e"] * 1e9, abs=1e3)
    assert values["sluice.api"] == "chat"
    assert values["sluice.tenant"] == TENANT
    assert values["sluice.traffic_class"] == "interactive"
    assert (values["sluice.outcome"], values["sluice.status"]) == ("completed", 200)
    assert values["sluice.generation_id"] == reply.id
    assert values["sluice.preemptions"] == 0
    assert values["sluice.slo.result"] in ("met", "missed")
    assert values["sluice.slo.reason"] in ("none", "ttft", "itl")
    # The scheduler's decisions, in order, within the span.
    assert span.event_names == ["queued", "dispatched", "first_token", "end"]
    times = [at for _, at, _ in span.events]
    assert span.start_ns <= times[0] and times == sorted(times) and times[-1] == span.end_ns
    assert span.events[-1][2] == {"sluice.outcome": "completed"}
    assert span.status == ProtoStatus.STATUS_CODE_UNSET
    # Its access line names the trace.
    wait_until(lambda: access_lines.where(request_id=request_id), 60, message="its access line")
    [line] = access_lines.where(request_id=request_id)
    assert line["trace_id"] == parent.trace_id


def test_a_request_without_a_traceparent_is_a_root_span_whose_trace_its_access_line_names(
    traced: InProcessSluice, receiver: OtlpReceiver, access_lines: AccessLines
) -> None:
    request_id = f"req-{uuid.uuid4().hex}"
    chat_client(traced).completions.create(
        model="sim", prompt="hi", max_tokens=3, extra_headers={"X-Request-Id": request_id}
    )
    wait_until(lambda: access_lines.where(request_id=request_id), 60, message="its access line")
    [line] = access_lines.where(request_id=request_id)
    [span] = receiver.wait_for(line["trace_id"])
    assert span.parent_span_id == ""
    assert span.attributes["gen_ai.request.id"] == request_id


def test_a_refused_request_s_span_is_short_and_an_error_with_its_code(
    traced: InProcessSluice, receiver: OtlpReceiver
) -> None:
    import openai

    parent = Parent()
    with pytest.raises(openai.RateLimitError):
        chat_client(traced, THRIFTY_KEY).chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=100,
            extra_headers=parent.headers(),
        )
    [span] = receiver.wait_for(parent.trace_id)
    assert_child_of(span, parent)
    assert span.status == ProtoStatus.STATUS_CODE_ERROR
    assert span.status_message == "tenant_quota_exceeded"
    values = span.attributes
    assert values["error.type"] == "tenant_quota_exceeded"
    assert (values["sluice.outcome"], values["sluice.status"]) == ("rejected", 429)
    assert values["sluice.tenant"] == "thrifty"
    assert "gen_ai.latency.time_in_queue" not in values  # it never queued
    assert span.event_names == ["end"]
    assert span.events[0][2] == {"sluice.outcome": "rejected"}


def test_an_unsampled_traceparent_makes_no_span_but_its_trace_is_in_the_access_line(
    traced: InProcessSluice, receiver: OtlpReceiver, access_lines: AccessLines
) -> None:
    """The SDK's default sampler follows the parent's sampled flag (OTEL_TRACES_SAMPLER
    changes it). Ordered by a sampled request sent after it on the same connection."""
    unsampled, sampled = Parent(sampled=False), Parent()
    request_id = f"req-{uuid.uuid4().hex}"
    client = chat_client(traced)
    for parent, headers in ((unsampled, {"X-Request-Id": request_id}), (sampled, {})):
        client.completions.create(
            model="sim", prompt="hi", max_tokens=2, extra_headers=parent.headers(**headers)
        )
    receiver.wait_for(sampled.trace_id)
    assert receiver.in_trace(unsampled.trace_id) == []
    [line] = access_lines.where(request_id=request_id)
    assert line["trace_id"] == unsampled.trace_id


def test_a_preempted_request_s_span_says_when_it_stopped_and_resumed(
    traced: InProcessSluice, receiver: OtlpReceiver
) -> None:
    """One seat, no reserve: a chat sent while bulk runs stops the bulk at once; the bulk
    waits, resumes after the chat, and its span shows both, and its wait in the scheduler."""
    bulk_parent, chat_parent = Parent(), Parent()
    preempted = traced.metric("sluice_bulk_preemptions_total")

    async def run(steps: HeldSteps) -> dict[str, dict[str, Any]]:
        finals: dict[str, dict[str, Any]] = {}
        url = traced.url.replace("http", "ws", 1) + "/v1/ws"
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            bulk = {"messages": [{"role": "user", "content": "a long job"}], "max_tokens": 200}
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": "bulk",
                        "request": bulk,
                        "traffic_class": "bulk",
                        "traceparent": bulk_parent.traceparent,
                        "tracestate": "router=r1",
                    }
                )
            )
            steps.step()  # its first token: the bulk streams
            chat_sent = False
            while len(finals) < 2:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert message["type"] in ("delta", "final"), message
                if message["type"] == "final":
                    finals[message["id"]] = message
                elif not chat_sent:  # the bulk streams: now the chat
                    chat_sent = True
                    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                    await ws.send(
                        json.dumps(
                            {
                                "type": "generate",
                                "id": "chat",
                                "request": chat,
                                "traceparent": chat_parent.traceparent,
                                "tracestate": "router=r1",
                            }
                        )
                    )
                    await asyncio.to_thread(
                        wait_until,
                        lambda: traced.metric("sluice_bulk_preemptions_total") == preempted + 1,
                        60,
                        message="the chat did not stop the bulk",
                    )
                    steps.run()
        return finals

    # The engine held: the bulk is 199 tokens short of its end when the chat stops it.
    with traced.held_steps() as steps:
        finals = asyncio.run(run(steps))
    assert list(finals) == ["chat", "bulk"]
    [span] = receiver.wait_for(bulk_parent.trace_id)
    assert_child_of(span, bulk_parent)
    assert span.attributes["sluice.traffic_class"] == "bulk"
    assert span.attributes["sluice.preemptions"] == 1
    assert span.attributes["gen_ai.usage.completion_tokens"] == 200
    assert span.event_names == [
        "queued",
        "dispatched",
        "first_token",
        "preempted",
        "resumed",
        "end",
    ]
    times = [at for _, at, _ in span.events]
    assert times == sorted(times)
    paused_s = (times[4] - times[3]) / 1e9
    latency = span.attributes
    assert latency["gen_ai.latency.time_in_scheduler"] == pytest.approx(
        latency["gen_ai.latency.time_in_queue"] + paused_s, abs=1e-6
    )
    [chat_span] = receiver.wait_for(chat_parent.trace_id)
    assert chat_span.attributes["sluice.preemptions"] == 0
    assert chat_span.attributes["sluice.api"] == "ws"


# -- every API ------------------------------------------------------------------------------


def test_every_http_api_s_request_is_a_span_in_its_traceparent_s_trace(
    traced: InProcessSluice, receiver: OtlpReceiver
) -> None:
    import anthropic

    client = chat_client(traced)
    sent: dict[str, Parent] = {api: Parent() for api in ("chat", "completions", "responses")}
    sent["messages"] = Parent()
    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_headers=sent["chat"].headers(),
    )
    assert len([chunk for chunk in stream]) > 0
    client.completions.create(
        model="sim", prompt="hi", max_tokens=3, extra_headers=sent["completions"].headers()
    )
    client.responses.create(
        model="sim",
        input="hi",
        max_output_tokens=3,
        extra_headers=sent["responses"].headers(),
    )
    anthropic.Anthropic(base_url=traced.url, api_key=KEY, max_retries=0).messages.create(
        model="sim",
        max_tokens=3,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers=sent["messages"].headers(),
    )
    for api, parent in sent.items():
        [span] = receiver.wait_for(parent.trace_id)
        assert_child_of(span, parent)
        assert span.attributes["sluice.api"] == api
        assert span.attributes["gen_ai.usage.completion_tokens"] == 3


def test_websocket_generations_are_spans_of_the_upgrade_s_trace_or_their_message_s(
    traced: InProcessSluice, receiver: OtlpReceiver
) -> None:
    """/v1/ws: a generate message's `traceparent`, else the upgrade request's header; the
    Responses WebSocket: the upgrade request's."""
    upgrade, own, responses = Parent(), Parent(), Parent()
    base = traced.url.replace("http", "ws", 1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def run() -> None:
        headers = {"Authorization": f"Bearer {KEY}", **upgrade.headers()}
        async with websockets.connect(base + "/v1/ws", additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "request": chat}))
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": "b",
                        "request": chat,
                        "traceparent": own.traceparent,
                        "tracestate": "router=r1",
                    }
                )
            )
            finals = 0
            while finals < 2:
                finals += json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "final"
        headers = {"Authorization": f"Bearer {KEY}", **responses.headers()}
        async with websockets.connect(base + "/v1/responses", additional_headers=headers) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "model": "sim",
                        "input": "hi",
                        "max_output_tokens": 2,
                    }
                )
            )
            # (It runs to max_output_tokens: incomplete, as OpenAI's says.)
            while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] not in TERMINAL:
                pass

    asyncio.run(run())
    for parent, api in ((upgrade, "ws"), (own, "ws"), (responses, "responses")):
        [span] = receiver.wait_for(parent.trace_id)
        assert_child_of(span, parent)
        assert span.attributes["sluice.api"] == api


def test_a_batch_s_lines_are_spans_of_the_batch_creating_request_s_trace(
    traced: InProcessSluice, receiver: OtlpReceiver
) -> None:
    parent = Parent()
    client = chat_client(traced)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        }
        for i in range(2)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers=parent.headers(),
    )
    spans = receiver.wait_for(parent.trace_id, count=2)
    assert sorted(span.attributes["gen_ai.request.id"] for span in spans) == [
        f"{batch.id}-0",
        f"{batch.id}-1",
    ]
    for span in spans:
        assert_child_of(span, parent)
        assert span.attributes["sluice.traffic_class"] == "bulk"


# -- off, and the composition -----------------------------------------------------------------


def _assembled(*args: str, env: dict[str, str] | None = None) -> Any:
    return assemble(parse_serve(["--engine", "sim", *args]), env or {})


def test_with_no_endpoint_no_tracer_is_built_even_with_the_otel_variables_set(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """As vLLM's: the standard variables configure the exporter, the flag turns it on."""
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    app = _assembled("--data-dir", str(tmp_path), env=env).app
    assert app.services.generations.tracing is None


def test_an_endpoint_builds_a_tracer_provider_of_the_app_s_own(
    receiver: OtlpReceiver, tmp_path: Path
) -> None:
    """Two apps of one process: two providers, neither the process's global one."""
    args = ("--otlp-traces-endpoint", receiver.url)
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    first = _assembled(*args, "--data-dir", str(tmp_path / "a"), env=env).app
    second = _assembled(*args, "--data-dir", str(tmp_path / "b"), env=env).app
    providers = [app.services.generations.tracing.provider for app in (first, second)]
    try:
        assert providers[0] is not providers[1]
        assert trace.get_tracer_provider() not in providers
    finally:
        for provider in providers:
            provider.shutdown()


def test_an_unknown_protocol_refuses_the_start(receiver: OtlpReceiver, tmp_path: Path) -> None:
    with pytest.raises(StartRefused, match="http/json"):
        _assembled(
            "--otlp-traces-endpoint",
            receiver.url,
            "--data-dir",
            str(tmp_path),
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
        )


def test_untraced_server_exports_nothing_and_logs_the_trace_it_was_sent(
    tmp_path: Path, access_lines: AccessLines
) -> None:
    """Tracing off, with a receiver where the standard variable points: nothing arrives there,
    even once the server has stopped (when a provider would have sent what it held), and the
    access lines still name the trace a request came with (its HTTP line too)."""
    receiver = OtlpReceiver()
    try:
        server = _serve(
            tmp_path,
            env={
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
        )
        parent, request_id = Parent(), f"req-{uuid.uuid4().hex}"
        try:
            chat_client(server).completions.create(
                model="sim",
                prompt="hi",
                max_tokens=2,
                extra_headers=parent.headers(**{"X-Request-Id": request_id}),
            )
            models = httpx.get(
                server.url + "/v1/models",
                headers={
                    "Authorization": f"Bearer {KEY}",
                    "X-Request-Id": "models-" + request_id,
                    **parent.headers(),
                },
                timeout=10,
            )
            assert models.status_code == 200
        finally:
            server.stop()
        assert receiver.posts == []
        assert [line["trace_id"] for line in access_lines.where(request_id=request_id)] == [
            parent.trace_id
        ]
        [line] = access_lines.where(request_id="models-" + request_id)
        assert line["trace_id"] == parent.trace_id
    finally:
        receiver.close()


# -- the span's parts, alone ----------------------------------------------------------------


def test_a_traceparent_is_read_as_w3c_says_and_a_malformed_one_names_no_trace() -> None:
    parent = Parent()
    assert TraceParent.of(parent.traceparent, "a=1").trace_id == parent.trace_id  # type: ignore[union-attr]
    assert TraceParent.of("00-not-a-trace-01").trace_id is None  # type: ignore[union-attr]
    assert TraceParent.of(None) is None and TraceParent.of(42) is None
    assert TraceParent.of("0" * 300) is None
    assert TraceParent.of(parent.traceparent, "x" * 600) == TraceParent(parent.traceparent)


def test_time_in_scheduler_adds_each_pause_to_the_first_wait() -> None:
    span = GenerationSpan(
        request_id="r",
        api="chat",
        model="m",
        tenant="t",
        traffic_class="bulk",
        outcome="expired",
        status=504,
        arrival=10.0,
        ended=20.0,
        queued=10.5,
        dispatched=11.0,
        first_token=12.0,
        pauses=[(13.0, 14.5), (16.0, None)],  # the second never resumed
        error="deadline_exceeded",
    )
    assert span.time_in_scheduler() == pytest.approx(1.0 + 1.5 + 4.0)
    assert [name for name, _, _ in span.events()] == [
        "queued",
        "dispatched",
        "first_token",
        "preempted",
        "resumed",
        "preempted",
        "end",
    ]
    values = span.attributes()
    assert values["sluice.preemptions"] == 2
    assert values["gen_ai.latency.time_in_model_decode"] == 0.0  # one write: no decode seen
    assert "gen_ai.request.max_tokens" not in values  # never planned


def test_by_default_spans_go_over_grpc_as_vllm_s_do() -> None:
    """No protocol variable: gRPC, to a `grpc://host:port` endpoint as vLLM's examples spell
    it, without TLS; a real gRPC receiver (OpenTelemetry's service definition) gets the span
    once the tracer is shut down (which sends what it holds)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(
            self, request: ExportTraceServiceRequest, context: Any
        ) -> ExportTraceServiceResponse:
            received.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracing = build_tracing(f"grpc://127.0.0.1:{port}", {})
        assert tracing is not None
        parent = Parent()
        trace_id = tracing.export(
            GenerationSpan(
                request_id="r-grpc",
                api="chat",
                model="m",
                tenant="t",
                traffic_class="interactive",
                outcome="completed",
                status=200,
                arrival=1.0,
                ended=1.5,
                parent=TraceParent(parent.traceparent, "router=r1"),
            )
        )
        tracing.shutdown()
    finally:
        server.stop(None)
    assert trace_id == parent.trace_id
    [span] = [span for request in received for span in decoded(request)]
    assert_child_of(span, parent)
    assert span.attributes["gen_ai.request.id"] == "r-grpc"
