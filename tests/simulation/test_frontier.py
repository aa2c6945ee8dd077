"""The bulk controller against the frontier, in virtual time, on several hosts.

Each case is the flood benchmark's load (96 closed-loop bulk streams, chats Poisson at 4/s)
on one simulated host: an engine's step curve (a CPU's line, a GPU's knee, this project's
machines as their calibrations read them, one steep and one nearly flat) and what the host
adds to it (the server's loop writing every token, the engine waiting for that loop's CPU,
steps that vary, requests that take the frontend time to read, a neighbour that slows the
whole host for a second or two at a time). The SLO is the benchmark's: 3x the TTFT p99 and
the median gap of chats alone on the same host. Then, as `bench/flood.py` does:

* the ladder: bulk at each fixed cap (`slo.bulk_cap_sequences`), and the frontier, the most
  bulk of a cap that keeps 95% of chats within the SLO;
* the controller, told the SLO in milliseconds: it must keep 95% of chats within it, with bulk
  at 0.9x the frontier or more. It is given neither the host nor the best cap: it starts from
  the calibration (run on the engine alone) and steers by what chats measured.

Judged from the tenth second on (the benchmark's warm-up), so the controller's first seconds
count, and it starts from nothing but the calibration. The SLO is the host's before any
slowdown: what was promised does not change when a neighbour arrives.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import Any

import pytest

from engine_adapters.sim_model import SimConfig
from server.core.config import parse_config
from server.scheduler.types import TrafficClass
from server.simulation.continuous import BulkStreams, ContinuousSimulation
from server.simulation.continuous_workload import RequestShape, WorkloadMix, poisson_mix
from server.simulation.host import HostConfig

SECONDS = 60.0
WARMUP = 10.0
CHATS_END = 2.0  # chats stop arriving this long before the end, and have time to finish
CHATS = RequestShape(16, 32, None)
BULK = RequestShape(100, 512, None)
LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)

CPU = SimConfig(
    step_base_ms=2.0, decode_ms_per_token=0.5, prefill_ms_per_token=0.35, kv_blocks=4096
)
# Flat up to 32 sequences, then as many tokens/s as at the knee: a step as long as its batch.
GPU = SimConfig(
    step_base_ms=10.0,
    decode_ms_per_token=10.0 / 32,
    decode_knee_tokens=32,
    prefill_ms_per_token=0.02,
    kv_blocks=4096,
)
# The demo model on vLLM here, as Sluice's start-up calibration logged it on 2026-12-03.
THIS_HOST = SimConfig(
    step_curve_ms=SimConfig.parse_curve(
        "1: 2.5 ms, 2: 3.2 ms, 4: 4.1 ms, 8: 6.4 ms, 16: 12.5 ms, 32: 19.4 ms, 64: 37.4 ms, "
        "128: 90.5 ms"
    ),
    prefill_ms_per_token=0.45,
    kv_blocks=4096,
)
# The demo model on vLLM on an Intel Xeon with AVX-512 (the start-up calibration of the flood of
# 2026-12-04 22:32): nearly flat to 16 sequences, so bulk moves chats' gaps little there.
FLAT = SimConfig(
    step_curve_ms=SimConfig.parse_curve(
        "1: 2.0 ms, 2: 2.3 ms, 4: 2.5 ms, 8: 2.9 ms, 16: 3.7 ms, 32: 5.4 ms, 64: 8.3 ms, "
        "128: 12.6 ms"
    ),
    prefill_ms_per_token=0.05,
    kv_blocks=4096,
)
# The frontend shares the engine's CPU (two cores: every write delays the next step).
SHARED_CPU = HostConfig(
    event_ms=0.1, contention=1.0, jitter=0.2, request_ms=8.0, request_jitter=0.6
)
# The frontend on cores of its own, beside an accelerator.
OWN_CORES = HostConfig(
    event_ms=0.05, contention=0.0, jitter=0.15, request_ms=8.0, request_jitter=0.6
)


@dataclasses.dataclass(frozen=True)
class Case:
    engine: SimConfig
    host: HostConfig
    bulk: RequestShape = BULK
    slo_factor: float = 3.0  # the SLO, as a multiple of what chats alone get
    seconds: float = SECONDS


CASES = {
    "cpu line": Case(CPU, SHARED_CPU),
    "gpu knee": Case(GPU, OWN_CORES),
    "this host's curve": Case(THIS_HOST, SHARED_CPU),
    "a flat curve": Case(FLAT, SHARED_CPU),
    # The same machine as the flood's ladder rows measured it (2026-12-04 and -05): chats' median
    # gaps at a fixed cap spread more the more bulk runs (their 97th percentile 1.12-1.19x the
    # median with no bulk, 1.21-1.31x at cap 4, 1.23-1.53x at caps 9 and 11, 1.54-1.76x at
    # 14), and cap 11 keeps 97-99% of chats, cap 14 90-94%. A neighbour whose slowing grows
    # with the outputs of each step (the load generators and the server's loop share the two
    # cores) and a lighter loop than the steep host's give the simulator the same.
    "a flat curve, this machine's noise": Case(
        FLAT,
        SHARED_CPU.model_copy(
            update={"event_ms": 0.06, "drift": 0.07, "drift_per_output": 0.013, "drift_s": 0.5}
        ),
    ),
    # As the flood's ladder rows measured this host (2026-12-03): chats' median gaps at a fixed
    # cap spread by a log sigma of 0.15-0.26, their 97th percentile 0.27-0.48 (log) above their
    # median, and a second's gaps correlated with the next one's. A neighbour whose slowing
    # has a log sigma of 0.2 and changes over a second gives the simulator the same.
    "this host's curve, a noisy neighbour": Case(
        THIS_HOST, SHARED_CPU.model_copy(update={"drift": 0.2, "drift_s": 1.0})
    ),
    # An SLO of 4x, since at 3x a host twice as slow leaves no room for bulk at all; two
    # minutes, so that the chats caught in the second the slowdown takes to undo (its cost,
    # whatever the run's length) are weighed against a minute either side, as a host that
    # slows down once a minute would weigh them.
    "cpu line, 2x slower from 60 s": Case(
        CPU,
        SHARED_CPU.model_copy(update={"slowdown_at_s": 60.0, "slowdown": 2.0}),
        slo_factor=4.0,
        seconds=2 * SECONDS,
    ),
    # Prompts of 4,096 tokens, prefilled in chunks of 512 (of 2,048 for the others).
    "gpu knee, long bulk prompts": Case(
        dataclasses.replace(GPU, max_batched_tokens=512, max_model_len=8192, kv_blocks=16384),
        OWN_CORES,
        RequestShape(4096, 512, None),
    ),
}


def run(case: Case, slo: dict[str, Any], *, bulk: bool = True, seed: int = 1) -> Any:
    simulation = ContinuousSimulation(
        parse_config({"slo": slo}), case.engine, host=case.host, keep_timelines=True
    )
    chats = WorkloadMix(interactive=CHATS)
    simulation.add_arrivals(poisson_mix(4.0, case.seconds - CHATS_END, chats, seed=seed))
    if bulk:
        simulation.add_bulk_streams(BulkStreams(96, case.bulk, until_s=case.seconds))
    simulation.run(until=case.seconds)
    return simulation


def benchmark_slo(case: Case) -> tuple[float, float]:
    """(TTFT, median gap) in seconds: 3x (the case's factor) the TTFT p99 and the median gap
    of chats alone, on the host as it is before any slowdown."""
    usual = dataclasses.replace(case, host=case.host.model_copy(update={"slowdown_at_s": None}))
    chats = [t for t in run(usual, {}, bulk=False, seed=99).timelines.values() if t.first_token]
    ttfts = sorted(t.first_token - t.arrival for t in chats)
    gaps = [t.median_gap for t in chats if t.median_gap is not None]
    factor = case.slo_factor
    return factor * ttfts[math.ceil(0.99 * len(ttfts)) - 1], factor * statistics.median(gaps)


def judged(simulation: Any, slo: tuple[float, float], seconds: float) -> tuple[float, float]:
    """(share of chats within the SLO, bulk tokens/s), of what arrived after the warm-up."""
    timelines = simulation.timelines.values()
    chats = [t for t in timelines if t.traffic_class == "interactive" and t.arrival >= WARMUP]
    met = sum(within(chat, slo) for chat in chats)
    bulk = sum(t.output_tokens for t in timelines if t.traffic_class == TrafficClass.BULK.value)
    return met / len(chats), bulk / seconds


def within(chat: Any, slo: tuple[float, float]) -> bool:
    """Whether a chat's timeline kept the SLO: completed, its first token and median gap in time."""
    return (
        chat.outcome == "completed"
        and chat.first_token is not None
        and chat.first_token - chat.arrival <= slo[0]
        and (chat.median_gap or 0.0) <= slo[1]
    )


def frontier(case: Case, slo: tuple[float, float]) -> float:
    """The most bulk tokens/s of a fixed cap that keeps 95% of chats within the SLO.

    The ladder is climbed until two caps in a row keep fewer: a higher cap runs more bulk
    beside the same chats. Every case's frontier is the one the whole ladder gives (checked
    rung by rung, 2026-12-07), at about half its runs (~13 s of the module's ~35 s of CPU)."""
    kept, missed = [], 0
    for cap in LADDER:
        share, bulk = judged(run(case, {"bulk_cap_sequences": cap}), slo, case.seconds)
        if share >= 0.95:
            kept.append(bulk)
            missed = 0
        else:
            missed += 1
            if missed == 2:
                break
    assert kept, "no fixed cap keeps 95% of chats: the case says nothing"
    return max(kept)


def stated(slo: tuple[float, float]) -> dict[str, Any]:
    return {"interactive": {"ttft_ms": 1000 * slo[0], "itl_ms": 1000 * slo[1]}}


# Known short (docs/design/bulk-controller-tuning-2026-12-04.md, "The flat curve", and -05.md, "A
# fresh server's aim"). A fresh server's aim starts at 0.65, below where the loop settles, and until
# chats show how they stray it rises only with the ceiling: on the flat curves that is 0.78-0.95x
# the best fixed cap over seeds 1-4 (the real flood on such a host: 0.96-1.16x told the SLO, which
# is what the start was set by). With a noisy neighbour, seed 1's slow second 15 s in meets bulk
# grown in the calm before it (0.89x). Strict: a controller that meets them turns this into a
# failure to remove.
SHORT = {
    "a flat curve": "a fresh server's aim starts below what this curve keeps",
    "a flat curve, this machine's noise": "a slow second's chats hold the aim down",
    "this host's curve, a noisy neighbour": "a slow second meets bulk grown in the calm",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=SHORT[name]))
        if name in SHORT
        else name
        for name in CASES
    ],
)
def test_told_the_slo_the_controller_keeps_it_with_the_frontiers_bulk(name: str) -> None:
    case = CASES[name]
    slo = benchmark_slo(case)
    best = frontier(case, slo)
    share, bulk = judged(run(case, stated(slo)), slo, case.seconds)
    assert share >= 0.95
    assert bulk >= 0.9 * best


def sampled(simulation: Any, every_s: float, read: Any) -> list[tuple[float, Any]]:
    """`read(simulation)` every `every_s` virtual seconds while it runs."""
    samples: list[tuple[float, Any]] = []
    for i in range(1, int(SECONDS / every_s)):
        at = i * every_s
        simulation.loop.call_at(at, lambda at=at: samples.append((at, read(simulation))))
    return samples


def test_the_controller_settles_rather_than_swings() -> None:
    case = CASES["cpu line"]
    slo = benchmark_slo(case)
    simulation = ContinuousSimulation(
        parse_config({"slo": stated(slo)}), case.engine, host=case.host
    )
    simulation.add_arrivals(
        poisson_mix(4.0, SECONDS - CHATS_END, WorkloadMix(interactive=CHATS), seed=1)
    )
    simulation.add_bulk_streams(BulkStreams(96, case.bulk, until_s=SECONDS))
    scales = sampled(simulation, 0.2, lambda s: s.core.controller.scale)
    simulation.run(until=SECONDS)
    settled = [math.log(scale) for at, scale in scales if at >= 20.0]
    # After its first seconds the scale wanders with the chats' noise, within a narrow band,
    # and does not swing: its moves are mostly small, none a jump.
    assert statistics.pstdev(settled) < 0.15
    assert max(settled) - min(settled) < 0.6
    assert max(abs(b - a) for a, b in itertools.pairwise(settled)) < 0.1


def test_chats_that_cannot_keep_their_target_shrink_bulk_to_its_floor_and_no_further() -> None:
    # A gap target below one engine step: no chat can keep it, whatever bulk does.
    case = CASES["cpu line"]
    simulation = ContinuousSimulation(
        parse_config({"slo": {"interactive": {"itl_ms": 1.0}}}), case.engine, host=case.host
    )
    simulation.add_arrivals(
        poisson_mix(4.0, SECONDS - CHATS_END, WorkloadMix(interactive=CHATS), seed=1)
    )
    simulation.add_bulk_streams(BulkStreams(96, case.bulk, until_s=SECONDS))
    core = simulation.core
    floor = core.bulk_cap.floor()
    running = sampled(simulation, 0.1, lambda s: s.core.running_count(TrafficClass.BULK))
    simulation.run(until=SECONDS)
    assert floor >= 1
    # Every chat missed, and bulk was cut to its floor: never below it, and above it only in
    # the moments between chats (when none has run for bulk_hold_ms).
    while_chats = [n for at, n in running if 1.0 <= at <= SECONDS - CHATS_END]
    assert min(while_chats) == floor
    assert statistics.mean(while_chats) < floor + 0.2
