"""vLLM's series (`vllm:*`) on a Sluice replica's /metrics, as vLLM's server exports them, fed
by requests, by the engine's scheduler and by Sluice's queue: the sim engine (and sim-batch)
in this process, on loopback. The real engine's are in `test_vllm_series_vllm.py`; vLLM's
Grafana dashboard's queries through a real Prometheus in `test_dashboards_prometheus.py`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import InProcessSluice, sim_sluice, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.service

MODEL = "sim"
ADAPTER = "tuned"
SERVED = {"model_name": MODEL, "engine": "0"}
LONG = {"X-Request-Timeout-Ms": "600000"}  # long answers, cut short by the tests
# Every series, by its family's type, as vLLM's server exports it (its family name as the
# exposition parser gives it: a counter's without `_total`).
SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}
REQUEST_HISTOGRAMS = [n for n, t in SERIES.items() if t == "histogram" and "request" in n]


def families(server: InProcessSluice) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(server.metrics_text())}


def one_seat_sim(root: Path) -> InProcessSluice:
    # One seat: a second request waits in Sluice's queue while a first runs. An adapter with a
    # slot: vLLM's LoRA series.
    return sim_sluice(
        root,
        "--sim-step-base-ms", "10",
        "--lora-modules", f"{ADAPTER}=adapters/{ADAPTER}", "--max-loras", "1",
        config="budgets: {max_running_seqs: 1}\n",
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with one_seat_sim(tmp_path_factory.mktemp("vllm-series")) as server:
        yield server


def test_every_series_is_there_from_the_start_at_zero(tmp_path: Path) -> None:
    with one_seat_sim(tmp_path) as server:
        found = families(server)
    for name, kind in SERIES.items():
        assert name in found, f"no {name}"
        assert found[name].type == kind, (name, found[name].type)
    for name in SERIES.keys() - {"vllm:cache_config_info", "vllm:lora_requests_info"}:
        for sample in found[name].samples:
            assert {k: sample.labels[k] for k in SERVED} == SERVED, sample
            if not sample.name.endswith("_created") and sample.labels.get("le") != "+Inf":
                assert sample.value == 0, sample  # (a histogram's buckets too, but none)
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    by_reason = found["vllm:num_requests_waiting_by_reason"].samples
    assert {s.labels["reason"] for s in by_reason} == {"capacity", "deferred"}
    [cache] = found["vllm:cache_config_info"].samples
    assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"]) == ("128", "512")
    [lora] = found["vllm:lora_requests_info"].samples
    assert lora.labels["max_lora"] == "1" and lora.labels["running_lora_adapters"] == ""
    # vLLM's bounds for token counts run 1, 2, 5, 10... up to the model's context (2048).
    bounds = [
        s.labels["le"]
        for s in found["vllm:request_prompt_tokens"].samples
        if s.name.endswith("_bucket")
    ]
    assert bounds[:4] == ["1.0", "2.0", "5.0", "10.0"] and bounds[-2:] == ["2000.0", "+Inf"]


def value(server: InProcessSluice, name: str, **labels: str) -> float:
    return server.metric(name, **SERVED, **labels)


def snapshot(server: InProcessSluice) -> dict[str, float]:
    names = [
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_prompt_tokens_sum",
        "vllm:request_generation_tokens_sum",
        "vllm:request_params_max_tokens_sum",
        "vllm:request_params_n_sum",
        *(f"{name}_count" for name in REQUEST_HISTOGRAMS),
    ]
    found = {name: value(server, name) for name in names}
    found["sluice_inter_token_latency_seconds_count"] = server.metric(
        "sluice_inter_token_latency_seconds_count"
    )
    for reason in ("stop", "length", "abort"):
        found[reason] = value(server, "vllm:request_success_total", finished_reason=reason)
    return found


def test_requests_streamed_whole_and_cancelled_feed_the_request_series(
    server: InProcessSluice,
) -> None:
    before = snapshot(server)
    import openai  # here, not at collection: ~0.5 s in every pytest-xdist worker

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    question = [{"role": "user", "content": "tell me about the locks on the canal"}]
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=question,  # type: ignore[arg-type]
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [chunk.usage for chunk in streamed if chunk.usage is not None]
    whole = client.chat.completions.create(model=ADAPTER, messages=question, max_tokens=7)  # type: ignore[arg-type]
    assert whole.usage is not None
    usages.append(whole.usage)
    after = snapshot(server)

    def grew(name: str) -> float:
        return after[name] - before[name]

    # Two requests, each once in every per-request histogram, under the served model's name
    # (the adapter's request too, as vLLM labels it); both ran to their max_tokens.
    for name in REQUEST_HISTOGRAMS:
        assert grew(f"{name}_count") == 2, name
    assert grew("length") == 2 and grew("stop") == grew("abort") == 0
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert generated == 12 + 7
    assert grew("vllm:prompt_tokens_total") == grew("vllm:request_prompt_tokens_sum") == prompt
    assert grew("vllm:generation_tokens_total") == generated
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_params_max_tokens_sum") == 12 + 7
    assert grew("vllm:request_params_n_sum") == 2
    # The gaps between tokens, counted in the same pass as Sluice's own.
    gaps = grew("vllm:inter_token_latency_seconds_count")
    assert gaps == grew("sluice_inter_token_latency_seconds_count") > 0
    assert value(server, "vllm:e2e_request_latency_seconds_sum") > 0
    assert not any(
        s.labels.get("model_name") == ADAPTER for f in families(server).values() for s in f.samples
    )

    # A client that leaves mid-stream: its request ends aborted, once.
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": MODEL, "messages": question, "max_tokens": 1500, "stream": True},
            headers=LONG,
        ) as response,
    ):
        for events, _ in enumerate(response.iter_lines()):
            if events == 6:
                break
    wait_until(
        lambda: (
            value(server, "vllm:request_success_total", finished_reason="abort")
            == before["abort"] + 1
        ),
        30,
        message="the cancelled request counted as aborted",
    )
    assert value(server, "vllm:e2e_request_latency_seconds_count") == (
        before["vllm:e2e_request_latency_seconds_count"] + 3
    )


def test_a_repeated_long_prompt_hits_the_prefix_cache(server: InProcessSluice) -> None:
    words = " ".join(f"lock{i % 97}" for i in range(400))  # three blocks of 128 and more
    body = {"model": MODEL, "prompt": words, "max_tokens": 2}
    queries = value(server, "vllm:prefix_cache_queries_total")
    hits = value(server, "vllm:prefix_cache_hits_total")
    cached = value(server, "vllm:prompt_tokens_cached_total")
    prompts = 0
    for _ in range(2):
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        prompts += reply["usage"]["prompt_tokens"]
    # Every prompt token of each new sequence is looked up; the second finds the first's
    # whole blocks.
    assert value(server, "vllm:prefix_cache_queries_total") - queries == prompts
    found = value(server, "vllm:prefix_cache_hits_total") - hits
    assert found >= 3 * 128
    assert value(server, "vllm:prompt_tokens_cached_total") - cached == found
    assert value(server, "vllm:iteration_tokens_total_sum") > 0


def test_waiting_counts_requests_in_sluices_queue(server: InProcessSluice) -> None:
    """One seat: a long request on the adapter runs, a second waits in Sluice's queue (the
    engine's own is empty), and a router reading vLLM's waiting sees it."""
    leave = threading.Event()

    def stream(model: str) -> None:
        """A long answer, read until the test is done."""
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "a long story, please"}],
            "max_tokens": 1500,
            "stream": True,
        }
        with (
            httpx.Client(base_url=server.url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body, headers=LONG) as response,
        ):
            for _ in response.iter_lines():
                if leave.is_set():
                    return

    def lora_running() -> str:
        [sample] = families(server)["vllm:lora_requests_info"].samples
        return str(sample.labels["running_lora_adapters"])

    clients = [threading.Thread(target=stream, args=(model,)) for model in (ADAPTER, MODEL)]
    clients[0].start()
    try:
        wait_until(
            lambda: value(server, "vllm:num_requests_running") == 1,
            30,
            message="the first request running in the engine",
        )
        assert value(server, "vllm:kv_cache_usage_perc") > 0
        wait_until(lambda: lora_running() == ADAPTER, 30, message="its adapter running")
        clients[1].start()
        wait_until(
            lambda: value(server, "vllm:num_requests_waiting") == 1,
            30,
            message="the second request waiting in Sluice's queue",
        )
        assert server.metric("sluice_queue_depth") == 1
        assert value(server, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
        assert value(server, "vllm:num_requests_running") == 1  # the engine's own: one seat
    finally:
        leave.set()
        for client in clients:
            if client.ident is not None:  # (started)
                client.join(30)
    wait_until(
        lambda: (
            value(server, "vllm:num_requests_waiting") == 0
            and value(server, "vllm:num_requests_running") == 0
        ),
        30,
        message="nothing waiting or running once both clients left",
    )


def test_the_sim_batch_engine_exports_them_too(tmp_path: Path) -> None:
    with InProcessSluice(["--engine", "sim-batch"], tmp_path / "server.log") as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "sluice gates", "max_tokens": 5}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        labels = {"model_name": model, "engine": "0"}
        assert server.metric("vllm:request_success_total", finished_reason="length", **labels) == 1
        assert server.metric("vllm:generation_tokens_total", **labels) == 5
        assert (
            server.metric("vllm:prompt_tokens_total", **labels) == (reply["usage"]["prompt_tokens"])
        )
        assert server.metric("vllm:iteration_tokens_total_count", **labels) == 1
        found = families(server)
        assert found.keys() >= SERIES.keys() - {"vllm:lora_requests_info"}
        assert "vllm:lora_requests_info" not in found  # (it serves no adapters)
