"""What vLLM's per-step stats cost the API process: `AsyncLLM` alone (no server), the demo
model on CPU, `--streams` (64) requests of `--tokens` (256) tokens at once, the process's own
CPU time (user + system; the engine core is another process) per token, in four set-ups:

- `off`: no stat logger, vLLM's stats off (Sluice before vLLM's series);
- `sluice`: Sluice's stat logger alone (`engine_adapters/vllm_stats.py`), vLLM's environment
  variables cached (`vllm.envs.enable_envs_cache`), as `VLLMEngine` runs it;
- `uncached`: the same without the cache (vLLM reads one per output token);
- `beside-default`: Sluice's logger as a plain one, so vLLM makes its own Prometheus logger too.

    python bench/vllm_stats_cpu.py [--alternations 3] [--rounds 3]
    python bench/vllm_stats_cpu.py --calls     # Python function calls per token instead

Each set-up runs in a process of its own (an engine each), in turn, `--alternations` times;
the medians over every round are printed last. Run it with no other engine busy (the tests
take /tmp/vllm.lock: `flock /tmp/vllm.lock python bench/vllm_stats_cpu.py`). On a busy host a
few µs drown in the noise; `--calls` counts the function calls the API process makes per token
(under cProfile), which do not depend on the host.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "sluice", "uncached", "beside-default")


async def measure(
    mode: str, rounds: int, streams: int, tokens: int, calls: bool = False
) -> list[float]:
    """API-process CPU µs per token, per round, of one set-up (`calls`: function calls per
    token instead)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(ROOT))
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.envs import enable_envs_cache
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    from engine_adapters.demo_model import build_demo_model
    from engine_adapters.protocol import EngineStats
    from engine_adapters.vllm_stats import EngineStatsLogger, engine_stats_logger

    stats = EngineStats()

    class Plain(AggregateStatLoggerBase):  # not a PrometheusStatLogger: vLLM adds its own
        def __init__(self, vllm_config: object, engine_indexes: list[int] | None = None):
            self.inner = EngineStatsLogger(vllm_config, engine_indexes, stats)  # type: ignore[arg-type]

        def record(self, *args: object, **kwargs: object) -> None:
            self.inner.record(*args, **kwargs)  # type: ignore[arg-type]

        def log_engine_initialized(self) -> None:
            pass

    loggers = {
        "off": None,
        "sluice": [engine_stats_logger(stats)],
        "uncached": [engine_stats_logger(stats)],
        "beside-default": [Plain],
    }[mode]
    model = build_demo_model(Path.home() / ".cache" / "sluice" / "demo-model")
    args = AsyncEngineArgs(
        model=str(model),
        disable_log_stats=True,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        seed=0,
    )
    llm = AsyncLLM.from_engine_args(args, stat_loggers=loggers)  # type: ignore[arg-type]
    if mode != "uncached":
        enable_envs_cache()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(request_id: str, i: int) -> int:
        got = 0
        prompt = {"prompt_token_ids": [1, 2, 3, 4 + i % 50]}
        async for out in llm.generate(prompt, params, request_id):  # type: ignore[arg-type]
            got += len(out.outputs[0].token_ids)
        return got

    try:
        await asyncio.gather(*(one(f"warm-{i}", i) for i in range(8)))
        per_token = []
        for r in range(rounds):
            profile = cProfile.Profile() if calls else None
            cpu = time.process_time()
            if profile is not None:
                profile.enable()
            got = sum(await asyncio.gather(*(one(f"{r}-{i}", i) for i in range(streams))))
            if profile is not None:
                profile.disable()
                per_token.append(pstats.Stats(profile).total_calls / got)
            else:
                per_token.append(1e6 * (time.process_time() - cpu) / got)
        return per_token
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, help="measure this set-up alone, here")
    parser.add_argument("--alternations", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calls", action="store_true", help="count function calls per token")
    args = parser.parse_args()
    shape = ["--rounds", str(args.rounds), "--streams", str(args.streams)]
    shape += ["--tokens", str(args.tokens), *(["--calls"] if args.calls else [])]
    unit = "calls/token" if args.calls else "µs/token"
    if args.mode is not None:
        rounds = asyncio.run(measure(args.mode, args.rounds, args.streams, args.tokens, args.calls))
        print("rounds:", " ".join(f"{x:.2f}" for x in rounds))  # (vLLM logs to stdout too)
        return
    found: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.alternations):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--mode", mode, *shape],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()
            line = next(line for line in out if line.startswith("rounds:"))
            rounds = [float(x) for x in line.removeprefix("rounds:").split()]
            found[mode] += rounds
            print(f"{mode:15} " + " ".join(f"{x:5.1f}" for x in rounds) + f" {unit}", flush=True)
    for mode, rounds in found.items():
        print(
            f"median per token in the API process, {mode}: {statistics.median(rounds):.1f} {unit}"
        )


if __name__ == "__main__":
    main()
