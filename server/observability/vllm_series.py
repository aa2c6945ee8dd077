"""vLLM's metric series (`vllm:*`), named, typed, bucketed and labelled as vLLM's server exports
them, beside Sluice's own: what reads a vLLM server's /metrics (vLLM's router, llm-d's endpoint
picker, vLLM's Grafana dashboard) reads a Sluice replica's, whichever engine it runs.

Three sources feed them (docs/observability.md, "vLLM's series"):
- each request, at its state changes (`RequestTimeline`), timed from its arrival at Sluice, so
  that the time it waited in Sluice's queue is in them, and recorded at its end but for its
  first token and its tokens' gaps (batched with Sluice's own, `BatchedPair`);
- the engine's own scheduler (`EngineClient.stats`), read when Prometheus scrapes;
- Sluice's queue: `vllm:num_requests_waiting` counts the requests waiting there as well as in
  the engine (Sluice dispatches only what fits, so the engine's own waiting is near 0).

Every series is labelled `model_name` (the served model: an adapter's requests too, as vLLM's)
and `engine` ("0"), and exists from the start, at zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from engine_adapters.protocol import STEP_TOKEN_BOUNDS, EngineClient, EngineStats
from server.core.errors import Outcome
from server.observability.counters import CounterReadAtScrape
from server.observability.histograms import BatchedChild, BatchedHistogram, HistogramReadAtScrape

ENGINE = "0"  # the engine label: one engine core, as vLLM's server without data parallelism
LABELS = ("model_name", "engine")
# vLLM's finish reasons (vllm.v1.engine.FinishReason), each a series of request_success_total.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")

# vLLM's bucket bounds (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0),
    *(10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08),
    *(0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5),
    *(10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
INTER_TOKEN_LATENCY_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50... up to the model's context length (vLLM's for token counts)."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class RequestTimes(Protocol):
    """What the request series read of a request as it ends (a `RequestTimeline`)."""

    arrival: float
    dispatched_at: float | None
    first_token_at: float | None
    last_write_at: float | None
    prompt_tokens: int
    generated_tokens: int
    n: int
    max_tokens: int


class VllmSeries:
    """One app's `vllm:*` series for `model_name`, made once its engine has started (the token
    histograms' buckets are its context length's, as vLLM's are), reading `engine` and the
    requests in Sluice's queues (`queued`) at each scrape."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        engine: EngineClient,
        queued: Callable[[], int],
    ) -> None:
        self._registry = registry
        self._labels = (model_name, ENGINE)
        tokens = request_token_buckets(engine.model.max_model_len)
        # --- Per request (`RequestTimeline`) ---
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._time_per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._inference_time = self._histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._decode_time = self._histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prompt_tokens_per_request = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self._generation_tokens_per_request = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self._max_generation_tokens = self._histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self._params_n = self._histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            REQUEST_PARAMS_N_BUCKETS,
        )
        self._params_max_tokens = self._histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens,
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self._success = {r: success.labels(*self._labels, r) for r in FINISHED_REASONS}
        self.prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self._engine_series(engine, queued)

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> BatchedChild:
        family = BatchedHistogram(
            name, documentation, LABELS, buckets=buckets, registry=self._registry
        )
        return family.labels(*self._labels)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, LABELS, registry=self._registry).labels(*self._labels)

    def finished(
        self,
        request: RequestTimes,
        outcome: Outcome,
        now: float,
        finish_reasons: Sequence[str],
        cached_tokens: int | None,
    ) -> None:
        """A request that reached the engine ended (`now`): its completed choices by the
        engine's finish reasons, or else once as aborted (the client left, the deadline passed)
        or failed. The phases as vLLM's: queued (here, from arrival at Sluice), then prefill
        (dispatch to the first token), then decode (to the last)."""
        dispatched = request.dispatched_at
        assert dispatched is not None
        first = request.first_token_at
        if first is None:
            first = now
        last = request.last_write_at or first
        generated, n = request.generated_tokens, request.n
        per_choice = -(-generated // n)  # each choice's tokens, had they all as many
        self._e2e.observe(now - request.arrival)
        self._queue_time.observe(max(0.0, dispatched - request.arrival))
        self._prefill_time.observe(first - dispatched)
        self._decode_time.observe(last - first)
        self._inference_time.observe(last - dispatched)
        self._time_per_output_token.observe(
            (last - first) / (per_choice - 1) if per_choice > 1 else 0.0
        )
        self._prompt_tokens_per_request.observe(request.prompt_tokens)
        self._generation_tokens_per_request.observe(generated)
        self._max_generation_tokens.observe(per_choice)
        self._params_n.observe(n)
        if request.max_tokens:
            self._params_max_tokens.observe(request.max_tokens)
        success = self._success
        if outcome == "completed":
            for reason in finish_reasons or ("stop",):
                success.get(reason, success["stop"]).inc()
        else:
            success["abort" if outcome in ("cancelled", "expired") else "error"].inc()
        if cached_tokens:
            self._prompt_tokens_cached.inc(cached_tokens)

    # --- The engine's scheduler and Sluice's queue, read at each scrape ---

    def _engine_series(self, engine: EngineClient, queued: Callable[[], int]) -> None:
        registry, labels = self._registry, self._labels
        stats = engine.stats

        def gauge(name: str, documentation: str, read: Callable[[], float]) -> None:
            Gauge(name, documentation, LABELS, registry=registry).labels(*labels).set_function(read)

        def counter(name: str, documentation: str, read: Callable[[], float]) -> None:
            CounterReadAtScrape(name, documentation, LABELS, registry=registry).set_function(
                labels, read
            )

        gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            lambda: stats().running,
        )
        gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            lambda: queued() + stats().waiting,
        )
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*LABELS, "reason"],
            registry=registry,
        )
        by_reason.labels(*labels, "capacity").set_function(
            lambda: queued() + stats().waiting - stats().deferred
        )
        by_reason.labels(*labels, "deferred").set_function(lambda: stats().deferred)
        gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            lambda: stats().kv_cache_usage,
        )
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            lambda: stats().prefix_cache_queries,
        )
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            lambda: stats().prefix_cache_hits,
        )
        counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            lambda: stats().preemptions,
        )
        HistogramReadAtScrape(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            dict(zip(LABELS, labels, strict=True)),
            buckets=STEP_TOKEN_BOUNDS,
            read=lambda: (stats().step_tokens, stats().step_tokens_sum),
            registry=registry,
        )
        limits = engine.model.limits
        # vLLM's labels the routers read (llm-d's, for its prefix-cache scorer); vLLM's other
        # CacheConfig fields are its own settings.
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "engine"],
            registry=registry,
        ).labels(str(limits.kv_cache.block_size), str(limits.kv_cache.num_blocks), ENGINE).set(1)
        if limits.adapter_slots:  # (vLLM's exists only with LoRA on)
            registry.register(LoraRequestsInfo(limits.adapter_slots, stats))


class LoraRequestsInfo:
    """`vllm:lora_requests_info`: one series, whose labels name the adapters of the engine's
    running and waiting sequences (comma-separated) and the most that run at once, valued at
    the time it was read (vLLM sets its own series to the time of its last step: readers take
    the series of the latest time)."""

    NAME = "vllm:lora_requests_info"
    HELP = "Running stats on lora requests."
    LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

    def __init__(self, max_lora: int, stats: Callable[[], EngineStats]) -> None:
        self._max_lora = str(max_lora)
        self._stats = stats

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        stats = self._stats()
        waiting, running = ",".join(stats.waiting_adapters), ",".join(stats.running_adapters)
        family.add_metric([self._max_lora, waiting, running], time.time())
        yield family
