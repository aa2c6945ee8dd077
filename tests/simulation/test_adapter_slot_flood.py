"""LoRA adapter slots in virtual time: chats on one adapter while bulk floods two others, on an
engine of two slots (vLLM's `max_loras` 2, loading an adapter into a slot costing 5 ms).

The load is the flood benchmark's shape (closed-loop bulk streams, chats Poisson at 4/s) on the
CPU line of `test_frontier.py`, and the SLO is its own: 3x the TTFT p99 and the median gap of
the chats alone. The scheduler must keep the chats within it, never dispatch more distinct
adapters than the engine has slots (the engine never passes a request over for want of one),
leave the chats' slot to them while they come (bulk that took it between two chats would be
stopped for the next), and share the bulk between its two adapters.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from test_frontier import BULK, CHATS, CPU, SECONDS, judged

from server.core.config import parse_config
from server.scheduler.adapters import AdapterSlots
from server.scheduler.types import PreemptCause
from server.simulation.continuous import BulkStreams, ContinuousSimulation
from server.simulation.continuous_workload import WorkloadMix, poisson_mix

# One worker runs the module: the flood (a module fixture) is simulated once, not on each worker
# that takes one of its tests.
pytestmark = pytest.mark.xdist_group("adapter_slot_flood")

ENGINE = dataclasses.replace(CPU, max_loras=2, lora_load_ms=5.0)
BULK_ADAPTERS = ("bulk-a", "bulk-c")


def flood(*, bulk: bool = True, knows_slots: bool = True, seed: int = 1) -> ContinuousSimulation:
    simulation = ContinuousSimulation(parse_config({}), ENGINE, keep_timelines=True)
    if not knows_slots:
        # A stand-in for a scheduler that does not know the engine's slots (vLLM's server
        # leaves them to its engine): as many as it likes.
        simulation.core.seats.slots = AdapterSlots(1_000)
    chats = poisson_mix(4.0, SECONDS - 2.0, WorkloadMix(interactive=CHATS), seed=seed)
    simulation.add_arrivals([dataclasses.replace(a, model="chat-b") for a in chats])
    if bulk:
        for name in BULK_ADAPTERS:
            simulation.add_bulk_streams(
                BulkStreams(48, BULK, until_s=SECONDS, name=name, model=name)
            )
    simulation.run(until=SECONDS)
    return simulation


@pytest.fixture(scope="module")
def slo() -> tuple[float, float]:
    alone = [t for t in flood(bulk=False, seed=99).timelines.values() if t.first_token]
    ttfts = sorted(t.first_token - t.arrival for t in alone)
    gaps = [t.median_gap for t in alone if t.median_gap is not None]
    return 3 * ttfts[math.ceil(0.99 * len(ttfts)) - 1], 3 * statistics.median(gaps)


@pytest.fixture(scope="module")
def flooded() -> ContinuousSimulation:
    return flood()


def within_slo(simulation: ContinuousSimulation, slo: tuple[float, float]) -> float:
    return judged(simulation, slo, SECONDS)[0]


def bulk_tokens(simulation: ContinuousSimulation) -> dict[str, int]:
    timelines = simulation.timelines.values()
    return {
        name: sum(t.output_tokens for t in timelines if t.id.startswith(name))
        for name in BULK_ADAPTERS
    }


def test_chats_on_another_adapter_keep_their_slo(
    flooded: ContinuousSimulation, slo: tuple[float, float]
) -> None:
    assert within_slo(flooded, slo) >= 0.95


def test_bulk_leaves_the_chats_slot_to_them_while_they_come(
    flooded: ContinuousSimulation,
) -> None:
    # Chats at 4/s leave their adapter's slot empty between two of them often, but the bulk
    # hold keeps it: a chat has it taken from bulk only after a quiet spell longer than the
    # hold (none of these 239; 2-3 with seeds 2 and 3; 32-34 when bulk took every slot that
    # emptied).
    chats = [t for t in flooded.timelines.values() if not t.id.startswith(BULK_ADAPTERS)]
    assert flooded.core.preempted_for[PreemptCause.ADAPTER_SLOT] <= 0.02 * len(chats)


def test_the_engine_never_waits_for_a_slot(flooded: ContinuousSimulation) -> None:
    assert flooded.model.slot_waits == 0


def test_a_scheduler_blind_to_the_slots_leaves_chats_waiting_in_the_engine(
    slo: tuple[float, float],
) -> None:
    blind = flood(knows_slots=False)
    assert blind.model.slot_waits > 0
    assert within_slo(blind, slo) < 0.9


def test_two_bulk_adapters_share_the_bulk(flooded: ContinuousSimulation) -> None:
    tokens = bulk_tokens(flooded)
    assert min(tokens.values()) > 0  # neither starves
    assert max(tokens.values()) <= 1.3 * min(tokens.values())
