"""The batched histograms count what `prometheus_client.Histogram` would, and vLLM's series
(`server/observability/vllm_series.py`) use vLLM's own bounds."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine_adapters.protocol import STEP_TOKEN_BOUNDS, EngineStats
from server.observability.histograms import BatchedHistogram, BatchedPair, HistogramReadAtScrape
from server.observability.vllm_series import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    request_token_buckets,
)

SLUICE_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
VLLM_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.5, 2.5)


def buckets(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """The exposition's bucket, sum and count samples of `name`, by their names and labels."""
    samples = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name) and not line.startswith(f"{name}_created"):
            sample, value = line.rsplit(" ", 1)
            samples[sample.removeprefix(name)] = float(value)
    return samples


def same(found: dict[str, float], expected: dict[str, float]) -> bool:
    """Equal counts, and sums equal but for the order they were added in."""
    return found.keys() == expected.keys() and all(
        found[k] == pytest.approx(expected[k], rel=1e-12) for k in found
    )


def test_a_pair_counts_into_both_what_each_would_alone() -> None:
    rng = random.Random(7)
    values = [rng.expovariate(30.0) for _ in range(500)]
    values += [0.01, 0.05, 0.5, 3.0]  # on bounds of both, and past them all
    paired, alone = CollectorRegistry(), CollectorRegistry()
    pair = BatchedPair(
        BatchedHistogram("a", "a", ["m"], buckets=SLUICE_BOUNDS, registry=paired).labels("x"),
        BatchedHistogram("b", "b", ["m"], buckets=VLLM_BOUNDS, registry=paired).labels("x"),
    )
    pair.observe_many(values[:300])
    pair.observe_many(values[300:])
    for name, bounds in (("a", SLUICE_BOUNDS), ("b", VLLM_BOUNDS)):
        reference = Histogram(name, name, ["m"], buckets=bounds, registry=alone).labels("x")
        for v in values:
            reference.observe(v)
    assert same(buckets(paired, "a"), buckets(alone, "a"))
    assert same(buckets(paired, "b"), buckets(alone, "b"))


def test_one_observation_counts_as_a_histogram_s() -> None:
    batched, reference = CollectorRegistry(), CollectorRegistry()
    one = BatchedHistogram("h", "h", [], buckets=VLLM_BOUNDS, registry=batched).labels()
    other = Histogram("h", "h", buckets=VLLM_BOUNDS, registry=reference)
    for v in (0.0, 0.01, 0.02, 1.0, 90.0):
        one.observe(v)
        other.observe(v)
    assert same(buckets(batched, "h"), buckets(reference, "h"))


def test_an_engine_s_step_counts_are_read_at_scrape() -> None:
    stats = EngineStats()
    for tokens in (1, 7, 8, 300, 20000):
        stats.count_step(tokens)
    registry = CollectorRegistry()
    HistogramReadAtScrape(
        "steps",
        "steps",
        {"engine": "0"},
        buckets=STEP_TOKEN_BOUNDS,
        read=lambda: (stats.step_tokens, stats.step_tokens_sum),
        registry=registry,
    )
    found = buckets(registry, "steps")
    assert found['_bucket{engine="0",le="1.0"}'] == 1
    assert found['_bucket{engine="0",le="8.0"}'] == 3
    assert found['_bucket{engine="0",le="16384.0"}'] == 4
    assert found['_bucket{engine="0",le="+Inf"}'] == found['_count{engine="0"}'] == 5
    assert found['_sum{engine="0"}'] == 1 + 7 + 8 + 300 + 20000


@pytest.mark.vllm  # (vLLM's library, imported in this process: out of the quick tiers)
@pytest.mark.xdist_group("vllm_library")  # (the tests that import it share one worker)
def test_the_bounds_are_vllm_s_own() -> None:
    from vllm.v1.metrics import buckets as vllm

    assert REQUEST_LATENCY_BUCKETS == vllm.REQUEST_LATENCY_BUCKETS
    assert TIME_TO_FIRST_TOKEN_BUCKETS == vllm.TIME_TO_FIRST_TOKEN_BUCKETS
    assert INTER_TOKEN_LATENCY_BUCKETS == vllm.INTER_TOKEN_LATENCY_BUCKETS
    assert REQUEST_PARAMS_N_BUCKETS == vllm.REQUEST_PARAMS_N_BUCKETS
    assert STEP_TOKEN_BOUNDS == vllm.ITERATION_TOKENS_BUCKETS
    for context in (1, 100, 2048, 131072):
        assert list(request_token_buckets(context)) == vllm.build_1_2_5_buckets(context)
