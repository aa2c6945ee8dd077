"""API-process CPU per token on the real engine: Sluice against vLLM's own server, in one run.

Both servers run the demo model on vLLM (CPU) with the same engine settings, both up for the
whole run, measured alternately. Each round opens `--streams` (64) streamed chats of
`--tokens` (256) tokens at once, read by raw sockets that only count (bench/frontend.py's
client), and reads the CPU time (user + system) of each server's API process alone: its
engine core is a child process and is not counted. What the API process spends per token is
the frontend's cost: HTTP, SSE, detokenizing, and for Sluice its scheduling too.

    python bench/api_cpu.py [--rounds 3] [--streams 64] [--tokens 256]
    python bench/api_cpu.py --old-root /tmp/old   # and an older checkout's Sluice beside them
    python bench/api_cpu.py --streams 256 --tokens 1 --rounds 5   # per request: short ones

With `--tokens 1` or 2, what is measured is the cost of a request itself (parsing, admission,
the response's set-up and teardown, the access log), and the figures are also given per
request.

A third system is the engine's floor (`bench/engine_floor.py`): a bare ASGI app on uvicorn that
renders the chat template, tokenizes, and streams what vLLM's `AsyncLLM` yields, with nothing
else. `AsyncLLM` runs its output processing, detokenizing and IPC in the API process, so no
server on it costs less than that floor; each row is also given above it, against vLLM's
server's distance above it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend import load
from throughput import ENGINE_SETTINGS, MODEL_NAME, RESULTS, ROOT, start, stop, wait_ready


def commands(
    model: Path, vllm_port: int, sluice_port: int, old: Path | None
) -> dict[str, tuple[int, list[str], str, Path]]:
    """Per system: its port, command, readiness path and working directory."""
    vllm = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(vllm_port),
        "--disable-log-stats", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    for key, value in ENGINE_SETTINGS.items():
        vllm += ["--" + key.replace("_", "-"), str(value)]
    sluice = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(model),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(sluice_port),
        "--log-level", "warning", "--data-dir", tempfile.mkdtemp(prefix="sluice-bench-"),
    ]  # fmt: skip
    for key, value in ENGINE_SETTINGS.items():
        sluice += ["--engine-arg", f"{key}={value}"]
    floor = [
        sys.executable, str(ROOT / "bench" / "engine_floor.py"), "--model", str(model),
        "--served-model-name", MODEL_NAME, "--port", str(sluice_port + 2),
    ]  # fmt: skip
    for key, value in ENGINE_SETTINGS.items():
        floor += ["--engine-arg", f"{key}={value}"]
    systems = {
        "vllm": (vllm_port, vllm, "/health", ROOT),
        "sluice": (sluice_port, sluice, "/ready", ROOT),
        "floor": (sluice_port + 2, floor, "/health", ROOT),
    }
    if old is not None:
        port = sluice_port + 1
        older = [*sluice, "--port", str(port), "--data-dir", tempfile.mkdtemp(prefix="sluice-old-")]
        systems["sluice-old"] = (port, older, "/ready", old)
    return systems


# Each stream's deadline (vLLM's server ignores the header). What is measured is the CPU per
# token, not admission: under its default 30 s, Sluice refused a round of 64 x 256 tokens on a
# slow host (predicted 27.5 s, plus its margin) with a 503.
DEADLINE_MS = 600_000


def round_once(port: int, pid: int, streams: int, tokens: int) -> tuple[float, float]:
    """(API-process CPU µs per token, tokens/s) of one round."""
    process = psutil.Process(pid)
    cpu, started = sum(process.cpu_times()[:2]), time.monotonic()
    results = asyncio.run(load("sse", port, streams, tokens, MODEL_NAME, DEADLINE_MS))
    took, cpu = time.monotonic() - started, sum(process.cpu_times()[:2]) - cpu
    total = sum(r.tokens for r in results)
    assert total == streams * tokens, f"{total} tokens streamed"
    return 1e6 * cpu / total, total / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--old-root", type=Path, help="also measure this checkout's Sluice (an older one)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from engine_adapters.demo_model import build_demo_model

    cache = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))
    model = build_demo_model(cache / "demo-model")
    systems = commands(model, 8303, 8304, args.old_root)
    RESULTS.mkdir(parents=True, exist_ok=True)
    procs = {
        name: start(cmd, RESULTS / f"api-cpu-{name}-server.log", cwd)
        for name, (_, cmd, _, cwd) in systems.items()
    }
    per_token: dict[str, list[float]] = {name: [] for name in systems}
    try:
        for name, (port, _, ready_path, _) in systems.items():
            wait_ready(f"http://127.0.0.1:{port}", procs[name], ready_path)
            round_once(port, procs[name].pid, 8, args.tokens)  # warm-up
        for round_no in range(args.rounds):
            order = list(systems) if round_no % 2 == 0 else list(reversed(systems))
            for name in order:
                port = systems[name][0]
                us, rate = round_once(port, procs[name].pid, args.streams, args.tokens)
                per_token[name].append(us)
                print(f"round {round_no} {name:6}: {us:6.1f} µs/token, {rate:6.0f} tokens/s")
    finally:
        for proc in procs.values():
            stop(proc)
    vllm, floor = (statistics.median(per_token[name]) for name in ("vllm", "floor"))
    for name in systems:
        median = statistics.median(per_token[name])
        above = (median - floor) / (vllm - floor) if vllm > floor else math.nan
        print(
            f"median API-process CPU per token: {name} {median:.1f} µs ({median / vllm:.2f}x vLLM"
            f", above the floor {above:.2f}x vLLM's); per request: "
            f"{median * args.tokens / 1000:.2f} ms"
        )


if __name__ == "__main__":
    main()
