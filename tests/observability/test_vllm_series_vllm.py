"""vLLM's series on a Sluice replica over the real vLLM engine: what vLLM's scheduler reports
each step reaches /metrics through Sluice's stat logger (`engine_adapters/vllm_stats.py`), and
the requests' series count what the clients got."""

from __future__ import annotations

import json

import httpx
from conftest import SluiceProcess, wait_until
from prometheus_client.parser import text_string_to_metric_families

MODEL = "sluice-demo"
SERVED = {"model_name": MODEL, "engine": "0"}


def value(server: SluiceProcess, name: str, **labels: str) -> float:
    return server.metric(name, **SERVED, **labels)


def test_the_engine_s_scheduler_reaches_the_vllm_series(vllm_server: SluiceProcess) -> None:
    server = vllm_server
    wait_until(
        lambda: server.metric("sluice_engine_unfinished_requests") == 0,
        30,
        message="engine idle before the test",
    )
    queries = value(server, "vllm:prefix_cache_queries_total")
    steps = value(server, "vllm:iteration_tokens_total_count")
    requests = value(server, "vllm:e2e_request_latency_seconds_count")
    lengths = value(server, "vllm:request_success_total", finished_reason="length")
    generated = value(server, "vllm:generation_tokens_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about the sluice gates"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen_running = seen_usage = 0.0
    usage = None
    with (
        httpx.Client(base_url=server.url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"usage":{' in line:
                usage = json.loads(line.removeprefix("data: "))["usage"]
            if not (seen_running and seen_usage):  # while it runs: the engine's own view
                seen_running = max(seen_running, value(server, "vllm:num_requests_running"))
                seen_usage = max(seen_usage, value(server, "vllm:kv_cache_usage_perc"))
    assert usage is not None and usage["completion_tokens"] == 400
    assert seen_running == 1 and 0 < seen_usage <= 1
    # vLLM looked the prompt up in its prefix cache, and counted its steps.
    assert value(server, "vllm:prefix_cache_queries_total") - queries >= usage["prompt_tokens"]
    assert value(server, "vllm:iteration_tokens_total_count") - steps >= 2
    wait_until(
        lambda: value(server, "vllm:e2e_request_latency_seconds_count") == requests + 1,
        30,
        message="the request's end recorded",
    )
    assert value(server, "vllm:request_success_total", finished_reason="length") == lengths + 1
    assert value(server, "vllm:generation_tokens_total") - generated == 400
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = {f.name: f for f in text_string_to_metric_families(text)}
    assert found["vllm:num_preemptions"].type == "counter"
    [cache] = found["vllm:cache_config_info"].samples
    assert int(cache.labels["block_size"]) > 0 and int(cache.labels["num_gpu_blocks"]) > 0
    assert "vllm:lora_requests_info" not in found  # this server serves no adapter
