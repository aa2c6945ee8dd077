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

Each LoRA adapter the engine serves is probed too: `ADAPTER_RUNS` runs alone on it, each
right after one of the base model's last solo runs, so that both are measured in the same
phase of the host. Its cost (`AdapterCost`) is the ratio of its median gap to those base runs'
median gap, and of its fastest first token to theirs: a step that runs an adapter costs more
than the base model's (twice, for the demo model's adapters on vLLM's CPU build), and a chat on
one is judged by its adapter's idle step and first token, not the base model's. An adapter
loaded at runtime is calibrated when it is loaded (`calibrate_adapter`), if calibration is on:
runs alone on it and on the base model in turn, on an engine that may be serving, which slows
both alike; until then, and if it cannot be timed within `ADAPTER_TIMEOUT_S`, its chats are
judged by the base model's targets. Those runs go to the engine beside the scheduler's
requests, which does not count them: one sequence, on one adapter, for a few tenths of a second.

`probe` drives a real engine; the simulator runs the same probe on its timing model in virtual
time; `seed` turns either's timings into estimates.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from engine_adapters.protocol import EngineClient, GenerationRequest, SamplingOptions
from server.scheduler.estimates import AdapterCost, RateEstimates

logger = logging.getLogger("sluice.calibration")

PROMPT = "Calibrating: one short prompt, about as long as a chat's first message."
SOLO_RUNS = 5
IDLE_S = 0.25  # before each run alone and the long prompt: idle, as between chats at 4 a second
LONG_PROMPT_TOKENS = 512
ADAPTER_RUNS = 3  # each adapter's runs alone: 45 gaps and 3 first tokens at 16 tokens a run
ADAPTER_TIMEOUT_S = 30.0  # an adapter loaded at runtime not timed by then is left uncalibrated

# One stream's timing: seconds to its first token, then the gap before each later token.
StreamTiming = tuple[float, list[float]]


@dataclass(frozen=True, slots=True)
class Probe:
    """What the probe measured."""

    solo: list[StreamTiming]
    together: dict[int, list[float]]  # concurrency -> every stream's gaps
    short_prompt_tokens: int
    long_prompt: tuple[int, float] | None  # (tokens, time to first token) of the long prompt
    # Each LoRA adapter's runs alone, among the second half of `solo`.
    adapters: dict[str, list[StreamTiming]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Calibration:
    idle_ttft_s: float
    step_s: dict[int, float]  # concurrency -> seconds per step
    prefill_tokens_per_s: float | None
    adapters: dict[str, AdapterCost] = field(default_factory=dict)


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


def adapter_cost(base: Sequence[StreamTiming], adapter: Sequence[StreamTiming]) -> AdapterCost:
    """An adapter's cost from its runs alone and the base model's beside them, by the base
    model's own rules: the ratio of their median gaps, and of their fastest first tokens. An
    adapter never costs less than the base model (a ratio under 1 is the host's noise)."""
    base_gaps = [gap for _, gaps in base for gap in gaps]
    gaps = [gap for _, gaps in adapter for gap in gaps]
    step = statistics.median(gaps) / statistics.median(base_gaps) if gaps and base_gaps else 1.0
    ttft = min(t for t, _ in adapter) / min(t for t, _ in base)
    return AdapterCost(max(1.0, step), max(1.0, ttft))


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
    beside = probe.solo[len(probe.solo) // 2 :]
    adapters = {name: adapter_cost(beside, runs) for name, runs in probe.adapters.items()}
    estimates.adapters.update(adapters)
    return Calibration(ttft, step_s, rate, adapters)


async def calibrate(
    engine: EngineClient,
    estimates: RateEstimates,
    *,
    max_sequences: int,
    tokens: int = 16,
    clock: Callable[[], float] = time.monotonic,
) -> Calibration:
    """Probe the engine, and each LoRA adapter it serves, and seed `estimates` with what they
    showed."""
    started = clock()
    timings = await probe(
        engine,
        max_sequences=max_sequences,
        tokens=tokens,
        clock=clock,
        adapters=list(engine.model.adapters),
    )
    result = seed(estimates, timings)
    logger.info(
        "engine calibrated in %.1fs: idle time to first token %.1f ms; prefill %s tokens/s; "
        "step time %s",
        clock() - started,
        1000 * result.idle_ttft_s,
        "?" if result.prefill_tokens_per_s is None else f"{result.prefill_tokens_per_s:.0f}",
        ", ".join(f"{n}: {1000 * s:.1f} ms" for n, s in result.step_s.items()),
    )
    for name, cost in result.adapters.items():
        _log_adapter(name, cost, result.step_s.get(1), result.idle_ttft_s)
    return result


def _log_adapter(name: str, cost: AdapterCost, step_s: float | None, ttft_s: float) -> None:
    logger.info(
        "LoRA adapter %r calibrated: idle step %s (%.2fx the base model's), idle time to first "
        "token %.1f ms (%.2fx)",
        name,
        "?" if step_s is None else f"{1000 * cost.step * step_s:.1f} ms",
        cost.step,
        1000 * cost.ttft * ttft_s,
        cost.ttft,
    )


async def calibrate_adapter(
    engine: EngineClient,
    estimates: RateEstimates,
    name: str,
    *,
    tokens: int = 16,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    timeout_s: float = ADAPTER_TIMEOUT_S,
) -> AdapterCost | None:
    """Time the adapter `name`, loaded at runtime, against the base model (each alone, in
    turn, `ADAPTER_RUNS` times), and judge its chats by it from then on. None: not timed within
    `timeout_s` (its requests, say, wait for a slot that a flood holds); its chats keep the
    base model's targets."""
    runs = _Runs(engine, tokens, clock, sleep)
    base: list[StreamTiming] = []
    adapter: list[StreamTiming] = []
    try:
        async with asyncio.timeout(timeout_s):
            for i in range(ADAPTER_RUNS):
                base.append(await runs.alone(f"sluice-calibration-1-{i}"))
                adapter.append(await runs.alone(f"sluice-calibration-{name}-{i}", adapter=name))
    except TimeoutError:
        logger.warning(
            "LoRA adapter %r not calibrated within %g s: its chats are judged by the base "
            "model's targets",
            name,
            timeout_s,
        )
        return None
    cost = estimates.adapters[name] = adapter_cost(base, adapter)
    step = estimates.steps.at(1.0) if estimates.steps.revision else None
    _log_adapter(name, cost, step, estimates.engine_ttft_s or 0.0)
    return cost


async def probe(
    engine: EngineClient,
    *,
    max_sequences: int,
    tokens: int,
    clock: Callable[[], float],
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    adapters: Sequence[str] = (),
) -> Probe:
    runs = _Runs(engine, tokens, clock, sleep)
    await runs.run("sluice-calibration-warmup")
    solo = [await runs.alone(f"sluice-calibration-1-{i}") for i in range(SOLO_RUNS)]
    together: dict[int, list[float]] = {}
    for n in levels(max_sequences)[1:]:
        timings = await asyncio.gather(*(runs.run(f"sluice-calibration-{n}-{i}") for i in range(n)))
        together[n] = [gap for _, gaps in timings for gap in gaps]
    long_ids = long_prompt(runs.prompt, engine.model.max_model_len)
    long_result = None
    if long_ids is not None:
        await sleep(IDLE_S)  # (its first token against the solo runs': idle, like theirs)
        long_ttft, _ = await runs.run("sluice-calibration-prefill", long_ids)
        long_result = (len(long_ids), long_ttft)
    on_adapter: dict[str, list[StreamTiming]] = {name: [] for name in adapters}
    for i in range(SOLO_RUNS, 2 * SOLO_RUNS):
        solo.append(await runs.alone(f"sluice-calibration-1-{i}"))
        for name, timings_on in on_adapter.items():  # each beside a base model's run
            if len(timings_on) < ADAPTER_RUNS:
                request_id = f"sluice-calibration-{name}-{len(timings_on)}"
                timings_on.append(await runs.alone(request_id, adapter=name))
    return Probe(solo, together, len(runs.prompt), long_result, on_adapter)


class _Runs:
    """The calibration prompt's runs on `engine`, `tokens` long, timed on `clock`."""

    def __init__(
        self,
        engine: EngineClient,
        tokens: int,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._sleep = sleep
        self.prompt = engine.tokenize(PROMPT)
        self._request = GenerationRequest(
            "sluice-calibration", self.prompt, SamplingOptions(max_tokens=tokens, ignore_eos=True)
        )

    async def run(
        self, request_id: str, prompt_ids: list[int] | None = None, adapter: str | None = None
    ) -> StreamTiming:
        clock = self._clock
        request = replace(
            self._request,
            request_id=request_id,
            prompt_token_ids=self.prompt if prompt_ids is None else prompt_ids,
            adapter=adapter,
        )
        sent = clock()
        deltas = [(clock(), len(delta.token_ids)) async for delta in self._engine.generate(request)]
        return stream_timing(sent, deltas)

    async def alone(self, request_id: str, adapter: str | None = None) -> StreamTiming:
        """A run after `IDLE_S` of idle, as a chat on an idle server finds its engine."""
        await self._sleep(IDLE_S)
        return await self.run(request_id, adapter=adapter)
