"""The server's start-up calibration probe (`server/scheduler/calibration.py`), run on the `sim`
timing model in virtual time, so that the simulator's scheduler starts from what the simulated
engine shows, as the server's does from its real engine."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from engine_adapters.sim_model import SimConfig, SimTimingModel
from server.scheduler.calibration import (
    ADAPTER_RUNS,
    SOLO_RUNS,
    Probe,
    StreamTiming,
    levels,
    long_prompt,
    stream_timing,
)

PROMPT_TOKENS = 14  # what the server's calibration prompt tokenizes to


def probe_timing_model(
    sim: SimConfig, *, max_sequences: int, tokens: int = 16, adapters: Sequence[str] = ()
) -> Probe:
    """The probe's timings on `sim`, with runs alone on each of `adapters` (each already in
    a slot, as a served adapter is in the server's engine). The timing model is deterministic,
    so a probe is run once per engine and kept: a sweep runs many simulations of one engine
    (the frontier's ladder: 16), each of which would otherwise calibrate anew. The `Probe` is
    shared: it is read (`calibration.seed`), never changed."""
    return _probe(sim, max_sequences, tokens, tuple(adapters))


@lru_cache(maxsize=32)
def _probe(sim: SimConfig, max_sequences: int, tokens: int, adapters: tuple[str, ...]) -> Probe:
    prompt = [7] * PROMPT_TOKENS

    def run(n: int, prompt_ids: list[int], adapter: str | None = None) -> list[StreamTiming]:
        model = SimTimingModel(sim, report_tokens=False)
        if adapter is not None:  # loaded into its slot first
            model.add("load", prompt_ids, 1, ignore_eos=True, adapter=adapter)
            while model.has_work:
                model.step()
        deltas: dict[str, list[tuple[float, int]]] = {f"p{i}": [] for i in range(n)}
        for request_id in deltas:
            model.add(request_id, prompt_ids, tokens, ignore_eos=True, adapter=adapter)
        now = 0.0
        while model.has_work:
            result = model.step()
            now += result.duration_s
            for request_id in result.request_ids:  # one token each
                deltas[request_id].append((now, 1))
        return [stream_timing(0.0, stream) for stream in deltas.values()]

    solo = run(1, prompt) * (2 * SOLO_RUNS)  # before and after: deterministic, all the same
    together = {
        n: [gap for _, gaps in run(n, prompt) for gap in gaps] for n in levels(max_sequences)[1:]
    }
    long_ids = long_prompt(prompt, sim.max_model_len)
    long_result = None if long_ids is None else (len(long_ids), run(1, long_ids)[0][0])
    on_adapters = {name: run(1, prompt, name) * ADAPTER_RUNS for name in adapters}
    return Probe(solo, together, len(prompt), long_result, on_adapters)
