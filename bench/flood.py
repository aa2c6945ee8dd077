"""Chat latency under a bulk flood: vLLM's own server (priority, FCFS) against Sluice.

One command starts each server in turn on the same model, offers the same load, and reports,
side by side, interactive TTFT p50/p99 and bulk tokens/s:

* bulk: `--bulk-streams` closed-loop streams (default 96), each asking for `--bulk-tokens`
  (512) tokens with `ignore_eos`, marked bulk (Sluice: `X-Traffic-Class: bulk`; vLLM priority
  mode: `priority: 10`), a new request as soon as the previous one ends;
* interactive: chats arriving as a Poisson process at `--chat-rate` per second (4), each for
  `--chat-tokens` (32) tokens (vLLM priority mode: `priority: -10`).

The bulk flood runs in its own process and counts tokens without parsing JSON, so the chat
client's stopwatch measures the server, not a load generator busy with 96 streams.

Only what happens in the measurement window (after `--warmup` seconds, for `--duration`
seconds) counts. Tokens are counted as streamed content chunks (one per token for these
servers). Usage:

    python bench/flood.py                                    # all three, on the demo model
    python bench/flood.py --systems sluice --duration 5 --bulk-streams 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

SERVED_NAME = "sluice-demo"
SYSTEMS = ("vllm-priority", "vllm-fcfs", "sluice")


@dataclass
class Measurements:
    window_start: float = 0.0
    window_end: float = float("inf")
    chat_ttft_s: list[float] = field(default_factory=list)
    chat_failures: int = 0
    bulk_tokens: int = 0
    bulk_failures: int = 0

    def in_window(self, t: float) -> bool:
        return self.window_start <= t < self.window_end


def server_command(system: str, args: argparse.Namespace, port: int) -> list[str]:
    if system == "sluice":
        command = [sys.executable, "-m", "server.cli", "serve", "--engine", args.sluice_engine,
                   "--model", args.model, "--served-model-name", SERVED_NAME, "--port", str(port)]
        if args.sluice_config:
            command += ["--config", args.sluice_config]
        return command
    policy = "priority" if system == "vllm-priority" else "fcfs"
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--served-model-name", SERVED_NAME, "--port", str(port),
            "--scheduling-policy", policy, *args.vllm_arg]


async def wait_ready(
    client: httpx.AsyncClient, process: asyncio.subprocess.Process, within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/v1/models", timeout=2.0)).status_code == 200:
                return
        await asyncio.sleep(1.0)  # polling a starting process: nothing to wait on instead
    raise RuntimeError("server not ready in time")


def request_body(system: str, max_tokens: int, bulk: bool, text: str) -> tuple[dict, dict]:
    body: dict[str, Any] = {
        "model": SERVED_NAME, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": text}],
    }
    headers: dict[str, str] = {}
    if system == "vllm-priority":
        body["priority"] = 10 if bulk else -10
    elif system == "sluice" and bulk:
        headers["X-Traffic-Class"] = "bulk"
    return body, headers


async def stream_tokens(client: httpx.AsyncClient, body: dict, headers: dict):
    """Yield once per streamed content chunk."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            for choice in chunk.get("choices", ()):
                if (choice.get("delta") or {}).get("content"):
                    yield


async def bulk_stream(client, system, args, window: tuple[float, float], counts: dict) -> None:
    """One closed-loop bulk stream. Tokens are counted from raw lines (no JSON parsing) so the
    load generator stays cheap; times are wall-clock (the window is shared across processes)."""
    start, end = window
    while time.time() < end:
        body, headers = request_body(system, args.bulk_tokens, True, "summarise the report " * 8)
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers=headers) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"role"' not in line:
                        now = time.time()
                        if start <= now < end:
                            counts["tokens"] += 1
                        elif now >= end:
                            return
        except (httpx.HTTPError, RuntimeError):
            if start <= time.time() < end:
                counts["failures"] += 1
            await asyncio.sleep(0.1)  # back off before reopening a refused stream


async def _bulk_load(system, args, port, window, counts) -> None:
    limits = httpx.Limits(max_connections=args.bulk_streams + 8)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(bulk_stream(client, system, args, window, counts)
                               for _ in range(args.bulk_streams)))


def bulk_load_process(system, args, port, window, results) -> None:
    """The bulk flood, in its own process so that its work cannot delay the chat client."""
    counts = {"tokens": 0, "failures": 0}
    asyncio.run(_bulk_load(system, args, port, window, counts))
    results.put(counts)


async def one_chat(client, system, args, m: Measurements) -> None:
    body, headers = request_body(system, args.chat_tokens, False, "hello, how are you today?")
    started = time.monotonic()
    try:
        async for _ in stream_tokens(client, body, headers):
            if m.in_window(started):
                m.chat_ttft_s.append(time.monotonic() - started)
            break  # TTFT is all we measure; closing the stream cancels the rest
    except (httpx.HTTPError, RuntimeError):
        if m.in_window(started):
            m.chat_failures += 1


async def chat_arrivals(client, system, args, m: Measurements, stop: asyncio.Event) -> None:
    rng = random.Random(args.seed)
    chats: set[asyncio.Task] = set()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(args.chat_rate))
        if not stop.is_set():
            task = asyncio.create_task(one_chat(client, system, args, m))
            chats.add(task)
            task.add_done_callback(chats.discard)
    for task in list(chats):
        task.cancel()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


async def measure(system: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    env = {**os.environ, "SLUICE_API_KEYS": ""} if system == "sluice" else dict(os.environ)
    quiet = not args.verbose
    process = await asyncio.create_subprocess_exec(
        *server_command(system, args, port), env=env,
        stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.STDOUT if quiet else None)
    limits = httpx.Limits(max_connections=args.bulk_streams + 256)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits,
                                     timeout=httpx.Timeout(600.0)) as client:
            await wait_ready(client, process, args.ready_timeout)
            m = Measurements()
            now, wall = time.monotonic(), time.time()
            m.window_start, m.window_end = now + args.warmup, now + args.warmup + args.duration
            window = (wall + args.warmup, wall + args.warmup + args.duration)
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            bulk = context.Process(target=bulk_load_process,
                                   args=(system, args, port, window, results))
            bulk.start()
            stop = asyncio.Event()
            chats = asyncio.create_task(chat_arrivals(client, system, args, m, stop))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.warmup + args.duration)
            stop.set()
            await asyncio.gather(chats, return_exceptions=True)
            counts = await asyncio.to_thread(results.get, True, 120)
            bulk.join(30)
            m.bulk_tokens, m.bulk_failures = counts["tokens"], counts["failures"]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
    ms = [1000 * t for t in m.chat_ttft_s]
    return {
        "system": system,
        "chats_measured": len(ms),
        "chat_failures": m.chat_failures,
        "chat_ttft_p50_ms": percentile(ms, 0.5),
        "chat_ttft_p99_ms": percentile(ms, 0.99),
        "bulk_tokens_per_s": round(m.bulk_tokens / args.duration, 1),
        "bulk_failures": m.bulk_failures,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    header = ["system", "chat TTFT p50 ms", "chat TTFT p99 ms", "chats", "chat errors",
              "bulk tok/s", "bulk errors"]
    keys = ["system", "chat_ttft_p50_ms", "chat_ttft_p99_ms", "chats_measured",
            "chat_failures", "bulk_tokens_per_s", "bulk_failures"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    lines += [" | ".join(cell(row[k]) for k in keys) for row in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="model path (default: the demo model, built on first use)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    p.add_argument("--bulk-streams", type=int, default=96)
    p.add_argument("--bulk-tokens", type=int, default=512)
    p.add_argument("--chat-rate", type=float, default=4.0, help="chats per second (Poisson)")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured")
    p.add_argument("--port", type=int, default=8111)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--sluice-config", default=None, help="YAML for Sluice's scheduler")
    p.add_argument("--sluice-engine", default="vllm", choices=("vllm", "sim"),
                   help="Sluice's engine; 'sim' only to smoke-test this script without a model")
    p.add_argument("--vllm-arg", action="append", default=[],
                   help="extra argument for vLLM's server, e.g. --vllm-arg=--max-model-len=2048")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--verbose", action="store_true", help="show the servers' output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The same KV cache for every system (vLLM's CPU default is larger than this machine holds).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from engine_adapters.demo_model import build_demo_model
        from server.cli import DEFAULT_CACHE

        args.model = str(build_demo_model(DEFAULT_CACHE / "demo-model"))
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        print(f"unknown systems: {sorted(unknown)}", file=sys.stderr)
        return 2
    rows = [asyncio.run(measure(system, args, args.port)) for system in systems]
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
