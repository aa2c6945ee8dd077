"""The start-up probe, against an engine on a virtual clock: a host in a slow phase when the
probe begins still gives its usual idle step, the idle step is the runs' median gap, not the
fastest run's, and the idle time to first token is the one a chat gets from an engine left idle,
not from one that has just served (and the prefill rate compares like with like). Each LoRA
adapter's cost is its runs against the base model's beside them, at start-up and when it is
loaded at runtime."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from engine_adapters.protocol import GenerationRequest
from server.core.config import parse_config
from server.scheduler.calibration import (
    ADAPTER_RUNS,
    IDLE_S,
    SOLO_RUNS,
    Probe,
    calibrate_adapter,
    probe,
    seed,
)
from server.scheduler.estimates import AdapterCost, RateEstimates

USUAL_STEP_S = 0.0017
SLOW_STEP_S = 1.2 * USUAL_STEP_S
WARM_TTFT_S = 0.004  # from dispatch to first token, the engine busy until just before
COLD_TTFT_S = 0.007  # the same after it idled `COLD_AFTER_S` or longer
COLD_AFTER_S = 0.1
PREFILL_TOKENS_PER_S = 100_000.0
PROMPT_TOKENS = 14  # the calibration prompt, as `tokenize` below makes it
TOKENS = 16
# A step that runs an adapter's sequence, and its first token, against the base model's.
ADAPTER_STEP, ADAPTER_TTFT = 2.0, 1.5


class VirtualEngine:
    """Every stream's tokens come one step apart, the host 20% slower until `slow_until` and
    from its `slow_from`th stream on; a stream's first token comes later when the engine has
    idled since its last token. The n-th stream's steps are `spread[n % len(spread)]` times the
    usual. A stream on an adapter takes `ADAPTER_TTFT` times as long to its first token, and
    `ADAPTER_STEP` times as long a step, unless it is in `hanging` (it never starts)."""

    def __init__(
        self,
        slow_until: float = 0.0,
        spread: tuple[float, ...] = (1.0,),
        slow_from: float = float("inf"),
        hanging: tuple[str, ...] = (),
    ) -> None:
        self.now = 0.0
        self.slow_until = slow_until
        self.slow_from = slow_from
        self.spread = spread
        self.hanging = hanging
        self.streams = 0
        self.busy_until = 0.0
        self.model = SimpleNamespace(max_model_len=2048)

    def clock(self) -> float:
        return self.now

    async def idle(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [7] * PROMPT_TOKENS

    async def generate(self, request: GenerationRequest) -> AsyncIterator[SimpleNamespace]:
        if request.adapter in self.hanging:
            await asyncio.Event().wait()
        on_adapter = request.adapter is not None
        cold = self.now - self.busy_until >= COLD_AFTER_S
        ttft_s = (COLD_TTFT_S if cold else WARM_TTFT_S) + len(
            request.prompt_token_ids
        ) / PREFILL_TOKENS_PER_S
        self.now += ADAPTER_TTFT * ttft_s if on_adapter else ttft_s
        factor = self.spread[self.streams % len(self.spread)]
        factor *= ADAPTER_STEP if on_adapter else 1.0
        slow = self.streams >= self.slow_from
        self.streams += 1
        for i in range(request.sampling.max_tokens):
            if i:
                slow_now = slow or self.now < self.slow_until
                self.now += factor * (SLOW_STEP_S if slow_now else USUAL_STEP_S)
            self.busy_until = self.now
            await asyncio.sleep(0)
            yield SimpleNamespace(token_ids=[7])


def run_probe(engine: VirtualEngine, adapters: tuple[str, ...] = ()) -> Probe:
    return asyncio.run(
        probe(
            engine,  # type: ignore[arg-type]
            max_sequences=8,
            tokens=TOKENS,
            clock=engine.clock,
            sleep=engine.idle,
            adapters=adapters,
        )
    )


def test_a_slow_phase_at_the_start_does_not_loosen_the_idle_step() -> None:
    # Slow through the warm-up and the first solo runs (each after its idle wait), no further.
    prefill_s = PROMPT_TOKENS / PREFILL_TOKENS_PER_S
    run_s = COLD_TTFT_S + prefill_s + (TOKENS - 1) * SLOW_STEP_S
    warm_up_s = WARM_TTFT_S + prefill_s + (TOKENS - 1) * SLOW_STEP_S
    engine = VirtualEngine(slow_until=warm_up_s + SOLO_RUNS * (IDLE_S + run_s) + USUAL_STEP_S / 2)
    timings = run_probe(engine)
    assert len(timings.solo) == 2 * SOLO_RUNS
    first = [gaps for _, gaps in timings.solo[:SOLO_RUNS]]
    assert all(gap == pytest.approx(SLOW_STEP_S) for gaps in first for gap in gaps)
    calibration = seed(RateEstimates(parse_config({}).estimates), timings)
    assert calibration.step_s[1] == pytest.approx(USUAL_STEP_S)


def test_the_idle_step_is_the_median_gap_not_the_fastest_runs() -> None:
    # Streams alone vary from run to run (the host's noise); a person's stream is judged against
    # the idle median gap, so the idle step is the median of the solo runs' gaps, and the
    # fastest run, below the median by the runs' spread, would tighten the default gap target.
    engine = VirtualEngine(spread=(0.9, 1.0, 1.05, 1.0, 1.1))
    timings = run_probe(engine)
    fastest = min(min(gaps) for _, gaps in timings.solo)
    assert fastest == pytest.approx(0.9 * USUAL_STEP_S)
    calibration = seed(RateEstimates(parse_config({}).estimates), timings)
    assert calibration.step_s[1] == pytest.approx(USUAL_STEP_S)


def test_the_idle_time_to_first_token_is_an_idle_engines() -> None:
    engine = VirtualEngine()
    timings = run_probe(engine)
    calibration = seed(RateEstimates(parse_config({}).estimates), timings)
    # Every solo run found the engine idle, as a chat on an idle server does; run back to back,
    # the fastest would have been the warm engine's.
    idle_ttft_s = COLD_TTFT_S + PROMPT_TOKENS / PREFILL_TOKENS_PER_S
    assert [ttft for ttft, _ in timings.solo] == pytest.approx([idle_ttft_s] * (2 * SOLO_RUNS))
    assert calibration.idle_ttft_s == pytest.approx(idle_ttft_s)
    # The long prompt's first token, against theirs, also from an idle engine: the difference
    # is its prefill alone.
    assert calibration.prefill_tokens_per_s == pytest.approx(PREFILL_TOKENS_PER_S)


def test_each_adapter_is_timed_beside_the_base_models_runs_and_a_slow_phase_cancels_out() -> None:
    # The host turns slow as the second solo runs begin (streams: the warm-up, five alone, 2 + 4
    # + 8 together, the long prompt), and stays slow through every adapter's runs. Its cost is
    # against the base model's runs beside them, slow alike; the idle step, the faster half's.
    engine = VirtualEngine(slow_from=1 + SOLO_RUNS + 14 + 1)
    timings = run_probe(engine, adapters=("a", "b"))
    assert [len(runs) for runs in timings.adapters.values()] == [ADAPTER_RUNS, ADAPTER_RUNS]
    estimates = RateEstimates(parse_config({}).estimates)
    calibration = seed(estimates, timings)
    assert calibration.step_s[1] == pytest.approx(USUAL_STEP_S)
    for name in ("a", "b"):
        cost = calibration.adapters[name]
        assert (cost.step, cost.ttft) == (pytest.approx(ADAPTER_STEP), pytest.approx(ADAPTER_TTFT))
        assert estimates.adapter_cost(name) == cost
    assert estimates.adapter_cost("unknown") == estimates.adapter_cost(None) == AdapterCost()


def test_an_adapter_loaded_at_runtime_is_timed_against_the_base_model_in_turn() -> None:
    engine = VirtualEngine(slow_until=1e9)  # slow throughout: the ratio holds all the same
    estimates = RateEstimates(parse_config({}).estimates)
    cost = asyncio.run(
        calibrate_adapter(engine, estimates, "late", clock=engine.clock, sleep=engine.idle)  # type: ignore[arg-type]
    )
    assert cost is not None and estimates.adapters["late"] == cost
    assert (cost.step, cost.ttft) == (pytest.approx(ADAPTER_STEP), pytest.approx(ADAPTER_TTFT))
    assert engine.streams == 2 * ADAPTER_RUNS


def test_an_adapter_that_cannot_be_timed_keeps_the_base_models_cost() -> None:
    # Its runs never start (a flood holds every slot, say): given up, judged as the base model.
    engine = VirtualEngine(hanging=("stuck",))
    estimates = RateEstimates(parse_config({}).estimates)
    cost = asyncio.run(
        calibrate_adapter(
            engine,  # type: ignore[arg-type]
            estimates,
            "stuck",
            clock=engine.clock,
            sleep=engine.idle,
            timeout_s=0.05,
        )
    )
    assert cost is None and "stuck" not in estimates.adapters
