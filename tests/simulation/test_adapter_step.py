"""Chats judged by their LoRA adapter's own step, in virtual time: the flood of
`test_adapter_slot_flood.py` (chats on one adapter while bulk floods two others, on two slots) on
an engine whose steps cost twice as much whenever they run an adapter's sequence.

Calibrated, each adapter's idle step is twice the base model's, and so is its chats' gap target:
the bulk cap lets bulk run about twice the sequences that the base model's targets would, and
the chats keep their own gap target and the benchmark's SLO (3x the TTFT p99 and the median gap
of the chats alone). Uncalibrated, the same chats are held to the base model's step.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from test_adapter_slot_flood import BULK_ADAPTERS, ENGINE
from test_frontier import BULK, CHATS, SECONDS, WARMUP, judged

from server.core.config import parse_config
from server.scheduler.estimates import AdapterCost
from server.scheduler.types import TrafficClass
from server.simulation.continuous import BulkStreams, ContinuousSimulation
from server.simulation.continuous_report import Timeline
from server.simulation.continuous_workload import WorkloadMix, poisson_mix

pytestmark = pytest.mark.xdist_group("adapter_step")

LORA_ENGINE = dataclasses.replace(ENGINE, lora_step_factor=2.0)
CHAT_ADAPTER = "chat-b"


@dataclasses.dataclass
class Flood:
    simulation: ContinuousSimulation
    bulk_running: float  # bulk sequences running, on average from the warm-up on


def flood(*, calibrated: bool, bulk: bool = True, seed: int = 1) -> Flood:
    adapters = (CHAT_ADAPTER, *BULK_ADAPTERS) if calibrated else ()
    simulation = ContinuousSimulation(parse_config({}), LORA_ENGINE, adapters=adapters)
    chats = poisson_mix(4.0, SECONDS - 2.0, WorkloadMix(interactive=CHATS), seed=seed)
    simulation.add_arrivals([dataclasses.replace(a, model=CHAT_ADAPTER) for a in chats])
    if bulk:
        for name in BULK_ADAPTERS:
            simulation.add_bulk_streams(
                BulkStreams(48, BULK, until_s=SECONDS, name=name, model=name)
            )
    running: list[int] = []
    times = [WARMUP + i / 10 for i in range(round(10 * (SECONDS - WARMUP)))]
    simulation.loop.feed(
        ((t, t) for t in times),
        lambda _: running.append(simulation.core.running_count(TrafficClass.BULK)),
    )
    simulation.run(until=SECONDS)
    return Flood(simulation, statistics.mean(running))


@pytest.fixture(scope="module")
def slo() -> tuple[float, float]:
    """3x the TTFT p99 and the median gap of the chats alone on their adapter."""
    alone = [t for t in chats(flood(calibrated=True, bulk=False, seed=99)) if t.first_token]
    ttfts = sorted(t.first_token - t.arrival for t in alone if t.first_token is not None)
    gaps = [t.median_gap for t in alone if t.median_gap is not None]
    return 3 * ttfts[math.ceil(0.99 * len(ttfts)) - 1], 3 * statistics.median(gaps)


@pytest.fixture(scope="module")
def own_step() -> Flood:
    return flood(calibrated=True)


@pytest.fixture(scope="module")
def base_step() -> Flood:
    return flood(calibrated=False)


def chats(run: Flood) -> list[Timeline]:
    """The chats that arrived after the warm-up."""
    return [
        t
        for t in run.simulation.timelines.values()
        if t.traffic_class == "interactive" and t.arrival >= WARMUP
    ]


def test_each_adapter_is_calibrated_at_its_own_step(own_step: Flood) -> None:
    core = own_step.simulation.core
    for name in (CHAT_ADAPTER, *BULK_ADAPTERS):
        assert core.estimates.adapter_cost(name) == AdapterCost(step=2.0, ttft=2.0)
    chat, base = core.bulk_cap.targets(CHAT_ADAPTER), core.bulk_cap.targets(None)
    assert chat.itl_s == pytest.approx(2 * base.itl_s)


def test_bulk_runs_far_more_beside_chats_judged_by_their_adapters_step(
    own_step: Flood, base_step: Flood
) -> None:
    assert own_step.bulk_running >= 1.5 * base_step.bulk_running


def test_the_chats_keep_their_own_gap_target_and_the_slo(
    own_step: Flood, slo: tuple[float, float]
) -> None:
    itl = own_step.simulation.core.bulk_cap.targets(CHAT_ADAPTER).itl_s
    gaps = [t.median_gap for t in chats(own_step) if t.median_gap is not None]
    assert sum(gap <= itl for gap in gaps) >= 0.97 * len(gaps)
    assert judged(own_step.simulation, slo, SECONDS)[0] >= 0.95
