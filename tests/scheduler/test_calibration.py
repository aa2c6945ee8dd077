"""The start-up probe, against an engine on a virtual clock whose host is in a slow phase when
the probe begins: the idle step it reports is the host's usual one, not the slow phase's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from engine_adapters.protocol import GenerationRequest
from server.core.config import parse_config
from server.scheduler.calibration import SOLO_RUNS, probe, seed
from server.scheduler.estimates import RateEstimates

USUAL_STEP_S = 0.0017
SLOW_STEP_S = 1.2 * USUAL_STEP_S
TOKENS = 16


class SlowPhaseEngine:
    """Every stream's tokens come one step apart; the host is 20% slower until `slow_until`."""

    def __init__(self, slow_until: float) -> None:
        self.now = 0.0
        self.slow_until = slow_until
        self.model = SimpleNamespace(max_model_len=2048)

    def clock(self) -> float:
        return self.now

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [7] * 14

    async def generate(self, request: GenerationRequest) -> AsyncIterator[SimpleNamespace]:
        for _ in range(request.sampling.max_tokens):
            self.now += SLOW_STEP_S if self.now < self.slow_until else USUAL_STEP_S
            await asyncio.sleep(0)
            yield SimpleNamespace(token_ids=[7])


def test_a_slow_phase_at_the_start_does_not_loosen_the_idle_step() -> None:
    # Slow through the first solo runs (the warm-up's and theirs: about 0.2 s of virtual time).
    engine = SlowPhaseEngine(slow_until=(SOLO_RUNS + 1) * TOKENS * SLOW_STEP_S)
    timings = asyncio.run(probe(engine, max_sequences=8, tokens=TOKENS, clock=engine.clock))  # type: ignore[arg-type]
    assert len(timings.solo) == 2 * SOLO_RUNS
    first = [gaps for _, gaps in timings.solo[:SOLO_RUNS]]
    assert all(gap == pytest.approx(SLOW_STEP_S) for gaps in first for gap in gaps)
    calibration = seed(RateEstimates(parse_config({}).estimates), timings)
    assert calibration.step_s[1] == pytest.approx(USUAL_STEP_S)
