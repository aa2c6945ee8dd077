"""A `traceparent` sent through vLLM's router (the real binary, which passes it on unchanged
with its own tracing off) comes out in the span exported by the replica that served it, with
the scheduler's decisions on it. Two sim replicas in processes of their own, each exporting
under its own service name to one real OTLP/HTTP receiver (tests/otlp.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import RedisProcess, RouterProcess, SluiceProcess, uncalibrated_config
from otlp import OtlpReceiver, Parent

pytestmark = pytest.mark.system  # replicas' and the router's processes


@pytest.fixture(scope="module")
def traced_fleet(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RouterProcess, list[SluiceProcess], OtlpReceiver]]:
    root = tmp_path_factory.mktemp("traced-fleet")
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    args = ["--engine", "sim", "--config", str(uncalibrated_config(root))]
    args += ["--otlp-traces-endpoint", receiver.url]
    with RedisProcess(root) as redis:
        replicas = [
            SluiceProcess(
                [*args, "--state-url", redis.url],
                root / f"replica-{name}.log",
                env={**env, "OTEL_SERVICE_NAME": f"replica-{name}"},
            )
            for name in ("a", "b")
        ]
        try:
            for replica in replicas:
                replica.wait_ready()
            with RouterProcess([r.url for r in replicas], root / "router.log") as router:
                yield router, replicas, receiver
        finally:
            for replica in replicas:
                replica.stop()
            receiver.close()


def test_a_traceparent_through_the_router_is_the_serving_replicas_spans_parent(
    traced_fleet: tuple[RouterProcess, list[SluiceProcess], OtlpReceiver],
) -> None:
    router, replicas, receiver = traced_fleet
    before = [replica.metric("sluice_requests_total") for replica in replicas]
    parent = Parent()
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    answer = httpx.post(router.url + "/v1/chat/completions", json=body, headers=parent.headers())
    assert answer.status_code == 200
    [span] = receiver.wait_for(parent.trace_id)
    # Its parent is the caller's span, as the router passed it on; the replica that counted
    # the request is the one that exported it.
    assert span.parent_span_id == parent.span_id and span.name == "llm_request"
    served = [
        replica.metric("sluice_requests_total") - count
        for replica, count in zip(replicas, before, strict=True)
    ]
    assert sorted(served) == [0, 1]
    assert span.service == f"replica-{'ab'[served.index(1)]}"
    # The scheduler's decisions, in order, and vLLM's attributes with the answer's values.
    names = span.event_names
    assert names.index("queued") < names.index("dispatched") < names.index("first_token")
    assert names[-1] == "end"
    assert span.attributes["gen_ai.usage.completion_tokens"] == 6
    assert span.attributes["gen_ai.usage.prompt_tokens"] == answer.json()["usage"]["prompt_tokens"]
