"""Sluice's vLLM stat logger: vLLM's logger manager makes it alone (not vLLM's own Prometheus
logger beside it), and it keeps what each step reports in `EngineStats`. vLLM's own classes, no
engine: the real engine's steps reaching /metrics are in
tests/observability/test_vllm_series_vllm.py."""

from __future__ import annotations

import pytest

from engine_adapters.protocol import STEP_TOKEN_BOUNDS, EngineStats

# vLLM's library, imported in this process (in the test: not where the quick tiers collect).
# The tests that import vLLM's library (torch and transformers with it: ~10 s of CPU) or
# transformers share one worker.
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_library")]


def test_vllm_makes_sluice_s_logger_alone_and_it_keeps_each_step() -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    from engine_adapters.vllm_stats import EngineStatsLogger, engine_stats_logger

    stats = EngineStats()
    # No configuration is read: a manager that made vLLM's own Prometheus logger would need one.
    manager = StatLoggerManager(
        vllm_config=None,  # type: ignore[arg-type]
        custom_stat_loggers=[engine_stats_logger(stats)],
        enable_default_loggers=False,
    )
    assert [type(logger).__mro__[1] for logger in manager.stat_loggers] == [EngineStatsLogger]
    manager.log_engine_initialized()

    for step in range(2):
        scheduler = SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            num_skipped_waiting_reqs=1,
            kv_cache_usage=0.25,
            prefix_cache_stats=PrefixCacheStats(queries=100, hits=64),
            running_lora_adapters={"tuned": 3},
            waiting_lora_adapters={"other": 1},
        )
        iteration = IterationStats()
        iteration.num_generation_tokens = 3
        iteration.num_preempted_reqs = step
        manager.record(scheduler, iteration)
        manager.log()

    assert (stats.running, stats.waiting, stats.deferred) == (3, 3, 1)
    assert stats.kv_cache_usage == 0.25
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (200, 128)
    assert stats.preemptions == 1
    assert stats.step_tokens[STEP_TOKEN_BOUNDS.index(8)] == 2  # two steps of 3 tokens
    assert stats.step_tokens_sum == 6
    assert (stats.running_adapters, stats.waiting_adapters) == (("tuned",), ("other",))
