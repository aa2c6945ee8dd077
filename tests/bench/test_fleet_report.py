"""The fleet benchmark's report: the sizing check, each fleet's row over turns 2 and later, the
ratio to round_robin, the flood's share within the SLO and the targets' verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "fleet_bench", Path(__file__).parents[2] / "bench" / "fleet.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["fleet_bench"] = bench  # (its dataclasses look their module up there)
_spec.loader.exec_module(bench)


def turn(conversation: int, n: int, prompt: int, cached: int, ttft_ms: float) -> Any:
    return bench.Turn(
        conversation,
        n,
        started=float(n),
        ttft_s=ttft_ms / 1000,
        gaps_s=[0.01, 0.01],
        total_s=ttft_ms / 1000 + 0.02,
        prompt_tokens=prompt,
        cached_tokens=cached,
    )


def test_the_default_cache_holds_the_conversations_in_the_fleet_not_in_one_replica() -> None:
    args = bench.parse_args([])
    size = bench.sizing(bench.workload(args), args.kv_blocks)
    assert size["exceeds_one_replica"] and size["fits_the_fleet"]
    # Its last turn fits the demo model's 2,048 tokens, answer included.
    w = bench.workload(args)
    assert w.last_prompt_tokens() + w.answer_tokens <= 2048


def test_a_row_counts_later_turns_only_and_weights_the_hit_share_by_tokens() -> None:
    turns = [
        turn(0, 1, 1000, 0, 100.0),  # a first turn: out of the row but for its own mean
        turn(0, 2, 1000, 900, 20.0),
        turn(1, 2, 3000, 1000, 60.0),  # a third cached: under half
        bench.Turn(1, 3, started=3.0, error="HTTP 503"),
    ]
    counted = [
        {"vllm:prefix_cache_queries": 3000.0, "vllm:prefix_cache_hits": 900.0},
        {"vllm:prefix_cache_queries": 1000.0, "vllm:prefix_cache_hits": 1000.0},
    ]
    row = bench.summarise("sluice", "cache_aware", turns, counted)
    assert row["later_turns"] == 2 and row["failures"] == 1
    assert row["hit_share"] == round(1900 / 4000, 4)
    assert row["half_cached_share"] == 0.5
    assert row["ttft_mean_ms"] == 40.0 and row["ttft_p50_ms"] == 20.0
    assert row["ttft_p99_ms"] == 60.0
    assert row["first_turn_ttft_mean_ms"] == 100.0
    assert row["replica_hit_share"] == round(1900 / 4000, 4)
    assert row["replica_token_split"] == [0.75, 0.25]


def test_without_the_replicas_counters_the_row_says_nothing_of_them() -> None:
    row = bench.summarise("sluice", "round_robin", [turn(0, 2, 100, 0, 5.0)], [{}, {}])
    assert "replica_hit_share" not in row and "replica_token_split" not in row


def test_without_vllms_counters_the_split_is_sluices_prompt_tokens() -> None:
    counted = [{"sluice_prompt_tokens": 600.0}, {"sluice_prompt_tokens": 200.0}]
    row = bench.summarise("sluice", "cache_aware", [turn(0, 2, 100, 0, 5.0)], counted)
    assert row["replica_token_split"] == [0.75, 0.25] and "replica_hit_share" not in row


def rows_of(sluice_rr: float, sluice_ca: float, vllm_rr: float) -> list[dict[str, Any]]:
    def row(system: str, policy: str, mean: float, hit: float, half: float) -> dict[str, Any]:
        return {
            "system": system,
            "policy": policy,
            "ttft_mean_ms": mean,
            "hit_share": hit,
            "half_cached_share": half,
        }

    return [
        row("sluice", "round_robin", sluice_rr, 0.4, 0.5),
        row("vllm", "round_robin", vllm_rr, 0.4, 0.5),
        row("sluice", "cache_aware", sluice_ca, 0.9, 0.95),
        row("vllm", "cache_aware", 30.0, 0.92, 0.97),
    ]


def test_each_policy_is_compared_with_round_robin_on_its_own_fleet() -> None:
    rows = rows_of(100.0, 40.0, 60.0)
    bench.add_ratios(rows)
    assert [r["ttft_vs_round_robin"] for r in rows] == [1.0, 1.0, 0.4, 0.5]


def test_the_targets_say_which_were_met_and_which_were_not() -> None:
    rows = rows_of(100.0, 40.0, 60.0)
    bench.add_ratios(rows)
    slo = (0.1, 0.02)
    fast = [turn(0, 2, 100, 90, 50.0) for _ in range(19)]
    result = {"turns": [*fast, turn(0, 3, 100, 90, 500.0)], "bulk_tokens_per_s": 800.0}
    floods = [
        bench.flood_row("sluice", "cache_aware", {**result, "bulk_failures": 0}, slo),
        bench.flood_row("vllm", "cache_aware", {**result, "bulk_failures": 0}, None),
        # Sluice's fleet told the SLO: judged apart, by the same SLO (2 of 20 over it: 90%).
        bench.flood_row(
            bench.TOLD,
            "cache_aware",
            {
                **result,
                "turns": [*fast[:18], *[turn(0, 3, 100, 90, 500.0)] * 2],
                "bulk_failures": 0,
            },
            slo,
        ),
    ]
    assert floods[0]["within_slo"] == 0.95 and floods[1]["within_slo"] is None
    assert floods[2]["within_slo"] == 0.9
    verdicts = bench.targets(rows, floods)
    assert [t["met"] for t in verdicts] == [True, True, False, True, False]
    assert verdicts[2]["value"] == round(0.9 - 0.92, 4)
    report = {
        "sizing": bench.sizing(bench.Workload(4, 1000, 3, 40, 32, 1.0), 30),
        "rows": rows,
        "flood": floods,
        "slo_ms": [100.0, 20.0],
        "args": {"bulk_streams": 8},
        "targets": verdicts,
    }
    text = bench.format_report(report)
    assert "hit share - vLLM's fleet's: -0.020 (goal >= 0): NOT met" in text
    assert "| 0.40x |" in text and "95.0%" in text


def test_unmeasured_targets_are_not_verdicts() -> None:
    verdicts = bench.targets([], [])
    assert [t["met"] for t in verdicts] == [None] * 5


def test_sluice_replicas_gauges_are_each_replicas_mean_and_its_verdicts_the_fleets() -> None:
    flood = sys.modules["flood"]  # (the one the bench imported)
    one, two = flood.Measurements(), flood.Measurements()
    one.samples = {"itl_target_ms": [5.0, 7.0], "bulk_cap": [3.0, 5.0]}
    two.samples = {"itl_target_ms": [9.0], "bulk_cap": [2.0]}
    one.counted = {"slo_met_none": [10.0, 40.0], "slo_missed_itl": [0.0, 5.0]}
    two.counted = {"slo_met_none": [0.0, 15.0], "slo_missed_ttft": [1.0, 1.0]}
    gauges = bench.sluice_gauges([one, two])
    assert gauges == {
        "ttft_target_ms": None,  # (not sampled on every replica)
        "itl_target_ms": [6.0, 9.0],
        "bulk_cap": [4.0, 2.0],
        "within_slo_by_sluice": round(45 / 50, 4),
    }
    assert bench.sluice_gauges([]) == {}  # (vLLM's fleet: none sampled)
