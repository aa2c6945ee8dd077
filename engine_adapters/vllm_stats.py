"""vLLM's scheduler, step by step, as Sluice's engine-neutral `EngineStats`.

vLLM hands the stats of each engine step (its scheduler's, and the step's outputs') to the
stat loggers an `AsyncLLM` is made with (`stat_loggers`: its public interface for them,
`StatLoggerBase`). `EngineStatsLogger` is one: it keeps the counts and the latest state in an
`EngineStats` the server reads when Prometheus scrapes, and observes nothing per token.

vLLM also makes a Prometheus logger of its own beside any custom one (in prometheus_client's
global registry, which Sluice does not serve), unless a custom one is itself a
`PrometheusStatLogger`. That one observes each output token's gap in a histogram on every
step, in the API process; docs/observability.md has what it costs. This logger keeps vLLM's
from being made the way vLLM provides for: it is a `PrometheusStatLogger`, one that declares
no series of its own (it does not run that class's `__init__`, which would) and overrides
every method vLLM's logger manager calls.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from engine_adapters.protocol import EngineStats


class EngineStatsLogger(PrometheusStatLogger):
    """Keeps `stats` (one engine: with data parallelism, its engine cores' counts add up, and
    its gauges are the last one's to report)."""

    def __init__(
        self, vllm_config: VllmConfig, engine_indexes: list[int] | None, stats: EngineStats
    ) -> None:
        self.engine_indexes = engine_indexes or [0]
        self.stats = stats

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        stats = self.stats
        if scheduler_stats is not None:
            deferred = scheduler_stats.num_skipped_waiting_reqs
            stats.running = scheduler_stats.num_running_reqs
            stats.waiting = scheduler_stats.num_waiting_reqs + deferred
            stats.deferred = deferred
            stats.kv_cache_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            stats.prefix_cache_queries += prefix.queries
            stats.prefix_cache_hits += prefix.hits
            stats.running_adapters = tuple(scheduler_stats.running_lora_adapters)
            stats.waiting_adapters = tuple(scheduler_stats.waiting_lora_adapters)
        if iteration_stats is not None:
            stats.preemptions += iteration_stats.num_preempted_reqs
            # The step's tokens as vLLM counts them: prompt tokens computed, and generated.
            stats.count_step(
                iteration_stats.prompt_token_stats.computed + iteration_stats.num_generation_tokens
            )

    def record_admission_rejection(self, reason: str) -> None:
        pass  # Sluice refuses before vLLM's queue limits are reached; it counts its own

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def log_metrics_info(self, type: str, config_obj: Any) -> None:
        pass


def engine_stats_logger(stats: EngineStats) -> type[EngineStatsLogger]:
    """The factory `AsyncLLM` takes (`stat_loggers`) for a logger that keeps `stats`. vLLM
    tells an aggregate logger's factory from a per-engine one's by its being a subclass of
    `AggregateStatLoggerBase`, so this is one: a subclass bound to `stats`."""

    class Bound(EngineStatsLogger):
        def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None):
            super().__init__(vllm_config, engine_indexes, stats)

    return Bound
