"""Bulk beyond the engine's seats, in virtual time: the sim engine of bench/seat_flood.py (32
seats, 5 ms steps, +0.02 ms a sequence), the scheduler core with its default configuration.

* a flood: 64 closed-loop bulk streams of 256 tokens, twice the seats, with chats at 4/s of 32
  tokens: at least 95% of the chats within 3x the idle TTFT p99 and 3x the idle median gap, and
  bulk at 0.9x or more of its tokens/s without chats;
* a Batch API job's shape: 64 lines at a time in the scheduler (the batch runner's window), each
  short (32 tokens), so the engine's seats turn over every few steps: chats' TTFT p99 within 2x
  of idle.

Sluice plans with the engine's seats (its `ModelInfo.limits`), so it never dispatches past them
and a chat never queues inside the engine behind bulk.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

import pytest

from engine_adapters.sim_model import SimConfig
from server.core.config import parse_config
from server.simulation.continuous import BulkStreams, ContinuousSimulation
from server.simulation.continuous_workload import RequestShape, WorkloadMix, poisson_mix

SEATS = 32
ENGINE = SimConfig(step_base_ms=5.0, decode_ms_per_token=0.02, max_num_seqs=SEATS)
SECONDS = 20.0
CHATS = WorkloadMix(interactive=RequestShape(16, 32, None))
FLOOD = BulkStreams(64, RequestShape(16, 256, None), until_s=SECONDS)
BATCH_LINES = BulkStreams(64, RequestShape(24, 32, None), until_s=SECONDS)


@dataclass(frozen=True)
class Chat:
    ttft_s: float
    median_gap_s: float


@dataclass(frozen=True)
class Run:
    chats: list[Chat]
    bulk_tokens_per_s: float
    peak_sequences: int
    bulk_starts: list[float]  # when each bulk request was dispatched, in order

    def ttft_p99(self) -> float:
        return statistics.quantiles([c.ttft_s for c in self.chats], n=100)[98]

    def median_gap(self) -> float:
        return statistics.median(c.median_gap_s for c in self.chats)


def run(bulk: BulkStreams | None, chats: bool = True) -> Run:
    simulation = ContinuousSimulation(parse_config({}), ENGINE)
    if chats:
        simulation.add_arrivals(poisson_mix(4.0, SECONDS, CHATS, seed=1))
    if bulk is not None:
        simulation.add_bulk_streams(bulk)
    simulation.run(until=SECONDS)
    timelines = simulation.timelines.values()
    done = [
        Chat(t.first_token - t.arrival, t.median_gap)
        for t in timelines
        if t.traffic_class == "interactive"
        and t.outcome == "completed"
        and t.first_token is not None
        and t.median_gap is not None
    ]
    asked = sum(t.traffic_class == "interactive" for t in timelines)
    assert len(done) == asked  # every chat completed
    bulk_tokens = sum(t.output_tokens for t in timelines if t.traffic_class == "bulk")
    starts = sorted(
        t.dispatched for t in timelines if t.traffic_class == "bulk" and t.dispatched is not None
    )
    return Run(done, bulk_tokens / SECONDS, simulation.peak_budget_in_use["sequences"], starts)


# The module's tests in one pytest-xdist worker, so that each run below is simulated once.
pytestmark = pytest.mark.xdist_group("seat_bound")


@pytest.fixture(scope="module")
def idle() -> Run:
    return run(None)


@pytest.fixture(scope="module")
def flood() -> Run:
    return run(FLOOD)


def test_a_flood_beyond_the_seats_keeps_the_chats_slo_and_bulk_its_rate(
    idle: Run, flood: Run
) -> None:
    alone = run(FLOOD, chats=False)
    assert flood.peak_sequences <= SEATS and alone.peak_sequences <= SEATS
    ttft_limit, gap_limit = 3 * idle.ttft_p99(), 3 * idle.median_gap()
    within = [c.ttft_s <= ttft_limit and c.median_gap_s <= gap_limit for c in flood.chats]
    assert len(within) > 60
    assert sum(within) / len(within) >= 0.95
    assert flood.bulk_tokens_per_s >= 0.9 * alone.bulk_tokens_per_s


def test_a_batch_turning_the_seats_over_keeps_the_chats_ttft_within_twice_idle(idle: Run) -> None:
    batch = run(BATCH_LINES)
    assert batch.peak_sequences <= SEATS
    assert batch.bulk_tokens_per_s > 0
    assert batch.ttft_p99() <= 2 * idle.ttft_p99()


def test_a_flood_of_one_length_restarts_spread_out_not_as_one_cohort(flood: Run) -> None:
    # 64 streams of 256 tokens: bulk started together would end together and come back as one
    # burst of starts every 256 steps, all in the step a chat may arrive in. Once chats are
    # about, starts go one step apart, and the spread holds.
    later = [at for at in flood.bulk_starts if at >= 2.0]
    assert len(later) > 200
    step_s = ENGINE.step_base_ms / 1000
    most_in_a_step = max(bisect.bisect_right(later, at + step_s) - i for i, at in enumerate(later))
    assert most_in_a_step <= 2
