"""Start-up calibration: the engine's step time at several concurrencies, and its idle time to
first token, measured before the server takes traffic.

The interactive targets are relative to the engine when nearly idle, and the bulk cap reads the
step time at each concurrency. Learned only online, a server that starts into a flood would
never see its engine idle, and would meet its first chats with priors that fit no hardware. So
the runtime runs a short probe first: one request to warm the engine up, then one request alone
`SOLO_RUNS` times (the idle references are the median of those runs, so one disturbed run does
not set them), then 2, 4, 8, ... requests together up to the sequence budget, each `tokens`
long. A level's step time is the median gap between a stream's tokens (one gap per token), so
the steps that prefill the other streams' prompts do not count. The online estimates go on
from these values.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine_adapters.protocol import EngineClient, GenerationRequest, SamplingOptions
from server.scheduler.estimates import RateEstimates

logger = logging.getLogger("sluice.calibration")

PROMPT = "Calibrating: one short prompt, about as long as a chat's first message."
SOLO_RUNS = 3


@dataclass(frozen=True, slots=True)
class Calibration:
    idle_ttft_s: float
    step_s: dict[int, float]  # concurrency -> seconds per step
    seconds: float  # how long the probe took


def levels(max_sequences: int) -> list[int]:
    """1, 2, 4, ... and the limit itself."""
    out = [1]
    while out[-1] * 2 < max_sequences:
        out.append(out[-1] * 2)
    if max_sequences > 1:
        out.append(max_sequences)
    return out


async def calibrate(
    engine: EngineClient, estimates: RateEstimates, *, max_sequences: int, tokens: int = 16,
    clock: Callable[[], float] = time.monotonic,
) -> Calibration:
    """Probe the engine and seed `estimates` with what it showed."""
    started = clock()
    prompt = engine.tokenize(PROMPT)
    sampling = SamplingOptions(max_tokens=tokens, ignore_eos=True)
    request = GenerationRequest("sluice-calibration", prompt, sampling)
    await _stream(engine, replace(request, request_id="sluice-calibration-warmup"), clock)
    solo = [await _stream(engine, replace(request, request_id=f"sluice-calibration-1-{i}"), clock)
            for i in range(SOLO_RUNS)]
    ttft = statistics.median(t for t, _ in solo)
    step_s: dict[int, float] = {}
    if all(gaps for _, gaps in solo):
        step_s[1] = statistics.median(statistics.median(gaps) for _, gaps in solo)
    for n in levels(max_sequences)[1:]:
        results = await asyncio.gather(*(
            _stream(engine, replace(request, request_id=f"sluice-calibration-{n}-{i}"), clock)
            for i in range(n)))
        gaps = [gap for _, stream_gaps in results for gap in stream_gaps]
        if gaps:
            step_s[n] = statistics.median(gaps)
    for n, step in step_s.items():
        estimates.steps.observe(n, step)
    estimates.observe_idle_ttft(ttft)
    result = Calibration(ttft, step_s, clock() - started)
    logger.info(
        "engine calibrated in %.1fs: idle time to first token %.1f ms; step time %s",
        result.seconds, 1000 * ttft,
        ", ".join(f"{n}: {1000 * s:.1f} ms" for n, s in step_s.items()),
    )
    return result


async def _stream(
    engine: EngineClient, request: GenerationRequest, clock: Callable[[], float]
) -> tuple[float, list[float]]:
    """One request's time to first token and its gaps between tokens (per token)."""
    sent = clock()
    first: float | None = None
    last = sent
    gaps: list[float] = []
    async for delta in engine.generate(request):
        now = clock()
        count = len(delta.token_ids)
        if count == 0:
            continue
        if first is None:
            first = now
        else:
            gaps.extend([(now - last) / count] * count)
        last = now
    return (first if first is not None else last) - sent, gaps
