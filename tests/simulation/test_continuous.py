"""The continuous simulator: the scheduler core and the sim timing model in virtual time."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from engine_adapters.sim import SimConfig
from server.cli import main
from server.core.config import SluiceConfig, TenantConfig, parse_config
from server.scheduler.types import TrafficClass
from server.simulation.continuous import ContinuousSimulation, summarize, with_tenants
from server.simulation.continuous_workload import RequestShape, WorkloadMix, poisson_mix
from server.simulation.workload import Arrival, parse_trace

BULK = TrafficClass.BULK
# 10 ms per step, no per-token cost: every timestamp is a multiple of 10 ms.
STEPS_OF_10MS = SimConfig(
    step_base_ms=10.0,
    decode_ms_per_token=0.0,
    prefill_ms_per_token=0.0,
    max_num_seqs=1,
    kv_blocks=64,
    block_size=16,
    max_model_len=1024,
)
# Rates from these priors alone (no calibration probe): exact for STEPS_OF_10MS, or optimistic.
EXACT_RATES = {
    "estimates": {"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 100.0, "calibrate": False}
}
OPTIMISTIC = {
    "estimates": {"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 1e9, "calibrate": False}
}


def simulate(config: SluiceConfig, sim: SimConfig, arrivals: Any) -> ContinuousSimulation:
    simulation = ContinuousSimulation(config, sim)
    simulation.add_arrivals(arrivals)
    simulation.run()
    return simulation


def assert_no_leaks(simulation: ContinuousSimulation) -> None:
    assert simulation.core.is_idle()
    assert simulation.core.ledger.in_use() == {"tokens": 0, "kv_blocks": 0, "sequences": 0}
    assert simulation.model.num_unfinished == 0


def test_request_that_cannot_meet_its_deadline_is_rejected_on_arrival() -> None:
    # A holds the engine's only seat for 20 steps (200 ms); E at 1 ms must finish by 150 ms.
    trace = parse_trace("A@0:max_tokens=20,E@1:deadline=150:max_tokens=2")
    sim = simulate(parse_config(EXACT_RATES), STEPS_OF_10MS, trace)
    e = sim.timelines["E"]
    assert (e.outcome, e.reason, e.finished) == ("rejected", "deadline_unmeetable", 0.001)
    assert sim.timelines["A"].finished == pytest.approx(0.200)
    assert_no_leaks(sim)


def test_queued_request_expires_at_its_deadline_and_never_reaches_the_engine() -> None:
    trace = parse_trace("A@0:max_tokens=20,E@1:deadline=150:max_tokens=2")
    sim = simulate(parse_config(OPTIMISTIC), STEPS_OF_10MS, trace)
    e = sim.timelines["E"]
    assert (e.outcome, e.stage, e.dispatched) == ("expired", "queued", None)
    assert e.finished == pytest.approx(0.150, abs=1e-9)
    assert_no_leaks(sim)


def test_running_request_is_aborted_at_its_deadline() -> None:
    trace = parse_trace("A@0:max_tokens=50:deadline=95")
    sim = simulate(parse_config(OPTIMISTIC), STEPS_OF_10MS, trace)
    a = sim.timelines["A"]
    assert (a.outcome, a.stage) == ("expired", "running")
    assert a.finished == pytest.approx(0.095, abs=1e-9)
    assert a.output_tokens == 9  # steps ending at 10..90 ms; the one ending at 100 ms is late
    assert_no_leaks(sim)


def test_cancelled_queued_request_is_removed_without_touching_the_engine() -> None:
    simulation = ContinuousSimulation(parse_config(OPTIMISTIC), STEPS_OF_10MS)
    simulation.add_arrivals(parse_trace("A@0:max_tokens=20,B@1,C@2"))
    simulation.cancel_at("B", 0.050)
    simulation.run()
    b = simulation.timelines["B"]
    assert (b.outcome, b.stage, b.dispatched) == ("cancelled", "queued", None)
    assert simulation.timelines["C"].dispatched == pytest.approx(0.200)
    assert_no_leaks(simulation)


def test_chat_during_a_bulk_flood_starts_within_about_one_engine_step() -> None:
    sim_config = SimConfig(
        step_base_ms=5.0,
        decode_ms_per_token=0.5,
        prefill_ms_per_token=0.01,
        max_num_seqs=16,
        kv_blocks=512,
        block_size=16,
        max_model_len=2048,
    )
    config = parse_config({**OPTIMISTIC, "budgets": {"interactive_reserve_share": 0.25}})
    # 64 bulk requests: 8 run and 56 wait until past the last chat (the first bulk ends at
    # ~4.6 s). A deeper flood only lengthens the run: with 200, every chat's dispatch and first
    # token are the same to the microsecond.
    flood = [
        Arrival(f"bulk{n}", 0.0, None, BULK, prompt_tokens=128, max_tokens=512) for n in range(64)
    ]
    chats = [
        Arrival(f"chat{n}", 1.0 + n * 0.5, None, prompt_tokens=32, max_tokens=16) for n in range(4)
    ]
    sim = simulate(config, sim_config, flood + chats)
    longest_step = (5.0 + 0.5 * 16 + 0.01 * 2048) / 1000
    for n in range(4):
        chat = sim.timelines[f"chat{n}"]
        assert chat.dispatched == chat.arrival  # the reserve was free: no queueing at all
        assert chat.first_token - chat.arrival <= 2 * longest_step  # the running step + its own
    assert_no_leaks(sim)


def two_tenant_config() -> SluiceConfig:
    base = parse_config(
        {
            "estimates": {"prefill_tokens_per_s": 20000, "decode_tokens_per_s": 100},
            "classes": {
                "interactive": {"max_queued": 200, "tenant_queue_share": 0.5, "deadline_ms": 5000}
            },
            "budgets": {"fairness_quantum_tokens": 256},
        }
    )
    tenants = {name: TenantConfig(name=name) for name in ("flood", "steady")}
    return base.model_copy(update={"tenants": tenants})


def test_a_chat_preempts_bulk_and_the_bulk_request_resumes_where_it_stopped() -> None:
    # Two seats, both taken by bulk; no interactive reserve, so only preemption makes room.
    two_seats = replace(STEPS_OF_10MS, max_num_seqs=2)
    budgets = {"interactive_reserve_share": 0.0, "bulk_min_share": 0.0}
    trace = parse_trace(
        "B1@0:class=bulk:max_tokens=100,B2@1:class=bulk:max_tokens=100,C@50:max_tokens=5"
    )

    waited = simulate(
        parse_config({**OPTIMISTIC, "budgets": {**budgets, "preempt_bulk_after_ms": None}}),
        two_seats,
        trace,
    )
    assert waited.timelines["C"].dispatched == pytest.approx(1.0, abs=0.011)  # B1's end

    preempted = simulate(
        parse_config({**OPTIMISTIC, "budgets": {**budgets, "preempt_bulk_after_ms": 100}}),
        two_seats,
        trace,
    )
    c, b1, b2 = (preempted.timelines[n] for n in ("C", "B1", "B2"))
    assert c.dispatched == pytest.approx(0.150)  # C's arrival + 100 ms, to the millisecond
    # The step that began at 150 ms was already under way; C's prefill is the next one.
    assert (c.outcome, c.first_token) == ("completed", pytest.approx(0.170))
    assert (b2.preemptions, b1.preemptions) == (1, 0)  # the later of the two
    for bulk in (b1, b2):
        assert (bulk.outcome, bulk.output_tokens) == ("completed", 100)
    summary = summarize(preempted, 0.0)
    assert summary["classes"]["bulk"]["preemptions"] == 1
    assert_no_leaks(preempted)


def test_flooding_tenant_cannot_take_the_other_tenants_share() -> None:
    sim_config = SimConfig(max_num_seqs=8, kv_blocks=256, block_size=16, max_model_len=1024)
    shape = RequestShape(64, 32, None)
    flood = poisson_mix(2000, 5.0, WorkloadMix(tenants=(("flood", 1.0),), interactive=shape), 1)
    steady = poisson_mix(20, 5.0, WorkloadMix(tenants=(("steady", 1.0),), interactive=shape), 2)
    arrivals = list(flood) + [replace(a, id=f"s{a.id}") for a in steady]
    sim = simulate(two_tenant_config(), sim_config, arrivals)
    outcomes: dict[str, dict[str, int]] = {"flood": {}, "steady": {}}
    for t in sim.timelines.values():
        outcomes[t.tenant][t.outcome] = outcomes[t.tenant].get(t.outcome, 0) + 1
    steady_total = sum(outcomes["steady"].values())
    assert outcomes["steady"] == {"completed": steady_total}  # its share holds
    assert outcomes["flood"].get("rejected", 0) > 0  # the flood pays for itself
    assert_no_leaks(sim)


def test_overload_at_ten_times_capacity_keeps_every_promise() -> None:
    # Capacity: 8 seats x ~1 request per (16 steps x ~6 ms) ~= 80 requests/s. Offer ~800/s.
    sim_config = SimConfig(
        step_base_ms=2.0,
        decode_ms_per_token=0.5,
        prefill_ms_per_token=0.01,
        max_num_seqs=8,
        kv_blocks=256,
        block_size=16,
        max_model_len=1024,
    )
    config = parse_config(
        {
            "classes": {
                "interactive": {"deadline_ms": 500, "max_queued": 64},
                "bulk": {"deadline_ms": 3000, "max_queued": 64},
            },
        }
    )
    mix = WorkloadMix(
        interactive_share=0.7,
        interactive=RequestShape(32, 16, None),
        bulk=RequestShape(64, 64, None),
    )
    arrivals = list(poisson_mix(800, 10.0, mix, seed=3))
    sim = simulate(config, sim_config, arrivals)
    outcomes: dict[str, int] = {}
    for t in sim.timelines.values():
        outcomes[t.outcome] = outcomes.get(t.outcome, 0) + 1
        if t.outcome == "completed":
            assert t.finished <= t.deadline
        elif t.outcome == "expired":
            assert t.finished == pytest.approx(t.deadline, abs=1e-9)
        else:
            assert t.outcome == "rejected" and t.finished == t.arrival  # answered at once
    assert outcomes["completed"] > 0 and outcomes["rejected"] > outcomes["completed"]
    assert_no_leaks(sim)
    summary = summarize(sim, 0.0)
    assert summary["budget_in_use_at_end"] == {"tokens": 0, "kv_blocks": 0, "sequences": 0}


def test_a_simulation_that_keeps_no_timelines_reports_the_same_summary() -> None:
    mix = WorkloadMix(
        interactive_share=0.5,
        tenants=(("a", 3.0), ("b", 1.0)),
        interactive=RequestShape(32, 16, None),
        bulk=RequestShape(64, 64, None),
    )
    config = parse_config({})
    config = config.model_copy(
        update={"tenants": {name: TenantConfig(name=name) for name in ("a", "b")}}
    )
    summaries = []
    for keep in (True, False):
        sim = ContinuousSimulation(config, SimConfig(max_num_seqs=8), keep_timelines=keep)
        sim.add_arrivals(poisson_mix(400, 3.0, mix, seed=4))
        sim.run(until=2.0)  # some still queued or running: counted as they stand
        summaries.append(summarize(sim, 0.0))
        assert len(sim.timelines) == (summaries[-1]["requests"] if keep else 0)
    kept, tallied = summaries
    assert kept == tallied
    assert kept["classes"]["interactive"]["outcomes"].get("running", 0) > 0


def test_cli_prints_timelines_and_summary_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["simulate", "--mode", "continuous", "--json", "--arrivals", "A@0,B@7,E@1:deadline=150"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["id"] for r in report["requests"]} == {"A", "B", "E"}
    assert report["summary"]["requests"] == 3
    assert report["summary"]["budget_in_use_at_end"]["sequences"] == 0


def test_cli_generated_mixed_workload(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--mode",
            "continuous",
            "--workload",
            "mixed",
            "--rate",
            "50",
            "--duration",
            "2",
            "--seed",
            "1",
        ]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["completed_tokens_by_tenant"]) <= {"flood", "steady"}
    assert summary["classes"]["bulk"]["requests"] > 0


def test_cli_refuses_a_host_whose_options_contradict_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["simulate", "--mode", "continuous", "--host-drift-per-output", "0.01"])
    assert code == 2
    assert "set drift too" in capsys.readouterr().err


def test_simulated_tenants_come_in_one_order_whatever_the_hash_seed() -> None:
    # The tenants named by --tenants arrive as a set; the bulk streams take the first of
    # them, so an order that followed the set's (the hash seed's) made runs differ.
    names = {f"tenant-{letter}" for letter in "hgfedcba"}
    assert list(with_tenants(parse_config({}), names).tenants) == sorted(names)
