"""Start-up calibration: the engine's step time at several concurrencies, its prefill rate and
its idle time to first token, measured before the server takes traffic.

The interactive targets are relative to the engine when nearly idle, and the bulk cap reads the
step time at each concurrency. Learned only online, a server that starts into a flood would
never see its engine idle, and would meet its first chats with priors that fit no hardware. So
the runtime runs a short probe first: one request to warm the engine up, then one request alone
`SOLO_RUNS` times, then 2, 4, 8, ... requests together up to the sequence budget, each `tokens`
long, then one alone with a long prompt, then one alone `SOLO_RUNS` times again. Each run alone
waits `IDLE_S` first, as a chat on an idle server finds its engine: an engine that has just
served is quicker to its first token than one left idle (the demo model on a 2-core Xeon, CPU
model 167: 3.9 ms from dispatch to first token back to back, 6.3 ms after 0.1 s idle, 7.2 ms
after 0.25 s, 7.4 ms after 1 s, at the median), and the online estimate, from chats that found
the engine nearly empty, measures the idle one. The idle time to first token is the fastest
solo run's: on a shared machine interference only ever slows a run down, and one disturbed run
would otherwise loosen every target. A level's step time is the median of every gap between its
streams' tokens (one gap per token), so the steps that prefill the other streams' prompts do not
count, nor one disturbed stream. The idle step, whose multiple is the default gap target, is
that median over the solo runs before the rest or over those after it, whichever is faster:
they come over a second apart because a host's slow phases outlast a run (on another 2-core
Xeon, the first five runs' fastest step ranged 1.71-2.04 ms over twelve probes on three engine
starts, the fastest of all ten 1.68-1.81 ms: `docs/design/bulk-controller-tuning-2026-12-05.md`).
The median, not the fastest run's: that is how a person's stream is judged, against the idle median
gap of chats; the fastest of ten runs is below it by the runs' spread (on the 2-core Xeon of CPU
model 167, 1.38-1.43 ms against a median of 1.42-1.46 over six probes). The prefill rate is the long
prompt's extra time to first token over the short one's. The online estimates go on from
these values.

`probe` drives a real engine; the simulator runs the same probe on its timing model in virtual
time; `seed` turns either's timings into estimates.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace

from engine_adapters.protocol import EngineClient, GenerationRequest, SamplingOptions
from server.scheduler.estimates import RateEstimates

logger = logging.getLogger("sluice.calibration")

PROMPT = "Calibrating: one short prompt, about as long as a chat's first message."
SOLO_RUNS = 5
IDLE_S = 0.25  # before each run alone and the long prompt: idle, as between chats at 4 a second
LONG_PROMPT_TOKENS = 512

# One stream's timing: seconds to its first token, then the gap before each later token.
StreamTiming = tuple[float, list[float]]


@dataclass(frozen=True, slots=True)
class Probe:
    """What the probe measured."""

    solo: list[StreamTiming]
    together: dict[int, list[float]]  # concurrency -> every stream's gaps
    short_prompt_tokens: int
    long_prompt: tuple[int, float] | None  # (tokens, time to first token) of the long prompt


@dataclass(frozen=True, slots=True)
class Calibration:
    idle_ttft_s: float
    step_s: dict[int, float]  # concurrency -> seconds per step
    prefill_tokens_per_s: float | None


def levels(max_sequences: int) -> list[int]:
    """1, 2, 4, ... and the limit itself."""
    out = [1]
    while out[-1] * 2 < max_sequences:
        out.append(out[-1] * 2)
    if max_sequences > 1:
        out.append(max_sequences)
    return out


def long_prompt(prompt: list[int], max_model_len: int) -> list[int] | None:
    length = min(LONG_PROMPT_TOKENS, max_model_len // 2)
    if length <= 2 * len(prompt):
        return None
    return (prompt * (length // len(prompt) + 1))[:length]


def stream_timing(sent: float, deltas: Iterable[tuple[float, int]]) -> StreamTiming:
    """A stream's timing from (time, tokens) of each delta; the tokens of one delta share the
    gap since the previous one."""
    first: float | None = None
    last = sent
    gaps: list[float] = []
    for at, count in deltas:
        if count <= 0:
            continue
        if first is None:
            first = at
        else:
            gaps.extend([(at - last) / count] * count)
        last = at
    return (first if first is not None else last) - sent, gaps


def seed(estimates: RateEstimates, probe: Probe) -> Calibration:
    """Seed `estimates` with what `probe` measured."""
    ttft = min(t for t, _ in probe.solo)
    step_s: dict[int, float] = {}
    if all(gaps for _, gaps in probe.solo):
        half = len(probe.solo) // 2
        runs = [probe.solo[:half], probe.solo[half:]]
        step_s[1] = min(statistics.median([g for _, gaps in r for g in gaps]) for r in runs if r)
    for n, gaps in probe.together.items():
        if gaps:
            step_s[n] = statistics.median(gaps)
    for n, step in sorted(step_s.items()):
        estimates.steps.observe(n, step)
    estimates.observe_engine_ttft(ttft)
    rate = None
    if probe.long_prompt is not None:
        tokens, long_ttft = probe.long_prompt
        if long_ttft > ttft:
            rate = (tokens - probe.short_prompt_tokens) / (long_ttft - ttft)
            estimates.prefill_tokens_per_s = rate
    return Calibration(ttft, step_s, rate)


async def calibrate(
    engine: EngineClient,
    estimates: RateEstimates,
    *,
    max_sequences: int,
    tokens: int = 16,
    clock: Callable[[], float] = time.monotonic,
) -> Calibration:
    """Probe the engine and seed `estimates` with what it showed."""
    started = clock()
    result = seed(
        estimates, await probe(engine, max_sequences=max_sequences, tokens=tokens, clock=clock)
    )
    logger.info(
        "engine calibrated in %.1fs: idle time to first token %.1f ms; prefill %s tokens/s; "
        "step time %s",
        clock() - started,
        1000 * result.idle_ttft_s,
        "?" if result.prefill_tokens_per_s is None else f"{result.prefill_tokens_per_s:.0f}",
        ", ".join(f"{n}: {1000 * s:.1f} ms" for n, s in result.step_s.items()),
    )
    return result


async def probe(
    engine: EngineClient,
    *,
    max_sequences: int,
    tokens: int,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Probe:
    prompt = engine.tokenize(PROMPT)
    request = GenerationRequest(
        "sluice-calibration", prompt, SamplingOptions(max_tokens=tokens, ignore_eos=True)
    )

    async def run(request_id: str, prompt_ids: list[int] = prompt) -> StreamTiming:
        sent = clock()
        deltas = [
            (clock(), len(delta.token_ids))
            async for delta in engine.generate(
                replace(request, request_id=request_id, prompt_token_ids=prompt_ids)
            )
        ]
        return stream_timing(sent, deltas)

    async def alone(i: int) -> StreamTiming:
        await sleep(IDLE_S)
        return await run(f"sluice-calibration-1-{i}")

    await run("sluice-calibration-warmup")
    solo = [await alone(i) for i in range(SOLO_RUNS)]
    together: dict[int, list[float]] = {}
    for n in levels(max_sequences)[1:]:
        timings = await asyncio.gather(*(run(f"sluice-calibration-{n}-{i}") for i in range(n)))
        together[n] = [gap for _, gaps in timings for gap in gaps]
    long_ids = long_prompt(prompt, engine.model.max_model_len)
    long_result = None
    if long_ids is not None:
        await sleep(IDLE_S)  # (its first token against the solo runs': idle, like theirs)
        long_ttft, _ = await run("sluice-calibration-prefill", long_ids)
        long_result = (len(long_ids), long_ttft)
    solo += [await alone(SOLO_RUNS + i) for i in range(SOLO_RUNS)]
    return Probe(solo, together, len(prompt), long_result)
