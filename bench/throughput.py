"""Throughput at saturation: Sluice vs vLLM's own OpenAI server, same engine, same client.

Both servers run the demo model with the same engine settings. vLLM's own benchmark client
(`vllm bench serve`: random dataset, 128 prompt / 128 output tokens, ignore_eos, 64 concurrent
streams) drives each in turn, alternating runs, and the medians are compared:
output tokens/s (goal: Sluice >= 1.05x vLLM), and TTFT and ITL p50 (goal: no worse).

    python bench/throughput.py [--rounds 5] [--num-prompts 512] [--traffic-class bulk]

With `--traffic-class bulk` every request carries `X-Traffic-Class: bulk` (vLLM's server
ignores the header): pure bulk, which Sluice runs under its bulk cap and up to the knee.

With `--adapters N` both servers serve N LoRA adapters of the demo model (its demo adapter's
variants 1 to N, all N in one step: `--max-loras N`), in float32 (vLLM 0.32's CPU LoRA in
bfloat16 dies on some hosts), and the client sends each request to the next adapter in turn
(vLLM's `--lora-assignment round-robin`): the mixed-adapter throughput of issue #33.

Both servers are up for the whole benchmark (idle while the other is measured) so start-up
cost is paid once; results go to bench/results/throughput-*.json and a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL_NAME = "sluice-demo"
ENGINE_SETTINGS = {"max_num_seqs": 128, "max_num_batched_tokens": 2048, "seed": 0}


def start(cmd: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, process_group=0
    )  # not a new session: see tests/conftest.py


def wait_ready(url: str, proc: subprocess.Popen[bytes], path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def bench_once(
    base_url: str,
    model_path: Path,
    num_prompts: int,
    concurrency: int,
    result_name: str,
    traffic_class: str,
    adapters: list[str] | None = None,
) -> dict:
    RESULTS.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "vllm_bench_client.py"),
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(model_path),
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "128",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(RESULTS),
        "--result-filename",
        result_name,
        "--disable-tqdm",
        "--header",
        f"X-Traffic-Class={traffic_class}",
        *(["--lora-modules", *adapters, "--lora-assignment", "round-robin"] if adapters else []),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((RESULTS / result_name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--warmup-prompts", type=int, default=128)
    parser.add_argument(
        "--adapters",
        type=int,
        default=0,
        metavar="N",
        help="serve N demo LoRA adapters on both servers, each request on the next in turn",
    )
    parser.add_argument(
        "--traffic-class",
        choices=("interactive", "bulk"),
        default="interactive",
        help="Sluice's class for every request",
    )
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from engine_adapters.demo_model import build_demo_adapter, build_demo_model

    cache = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))
    model = build_demo_model(cache / "demo-model")
    adapters = {
        f"adapter-{variant}": build_demo_adapter(
            cache / "throughput-adapters" / str(variant), model, variant=variant
        )
        for variant in range(1, args.adapters + 1)
    }
    settings = dict(ENGINE_SETTINGS, **({"dtype": "float32"} if adapters else {}))
    lora = (
        [
            "--lora-modules",
            *(f"{name}={path}" for name, path in adapters.items()),
            "--max-loras",
            str(len(adapters)),
        ]
        if adapters
        else []
    )
    vllm_port, sluice_port = 8301, 8302
    vllm_cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(vllm_port),
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]
    for key, value in settings.items():
        vllm_cmd += ["--" + key.replace("_", "-"), str(value)]
    vllm_cmd += ["--enable-lora", *lora] if adapters else []
    sluice_cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(sluice_port),
        "--log-level",
        "warning",
        "--data-dir",
        tempfile.mkdtemp(prefix="sluice-bench-"),
    ]
    for key, value in settings.items():
        sluice_cmd += ["--engine-arg", f"{key}={value}"]
    sluice_cmd += lora
    systems = {
        "vllm": (f"http://127.0.0.1:{vllm_port}", vllm_cmd, "/health"),
        "sluice": (f"http://127.0.0.1:{sluice_port}", sluice_cmd, "/ready"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    procs = {
        name: start(cmd, RESULTS / f"{name}-server.log") for name, (_, cmd, _) in systems.items()
    }
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    try:
        for name, (url, _, ready_path) in systems.items():
            wait_ready(url, procs[name], ready_path)
            bench_once(
                url,
                model,
                args.warmup_prompts,
                args.concurrency,
                f"warmup-{name}.json",
                args.traffic_class,
                list(adapters),
            )
        for round_no in range(args.rounds):
            order = list(systems) if round_no % 2 == 0 else list(reversed(systems))
            for name in order:
                url = systems[name][0]
                result = bench_once(
                    url,
                    model,
                    args.num_prompts,
                    args.concurrency,
                    f"throughput-{name}-{round_no}.json",
                    args.traffic_class,
                    list(adapters),
                )
                runs[name].append(result)
                print(
                    f"round {round_no} {name:6s}: {result['output_throughput']:8.0f} tok/s  "
                    f"TTFT p50 {result['p50_ttft_ms']:7.1f} ms  "
                    f"ITL p50 {result['p50_itl_ms']:6.2f} ms",
                    flush=True,
                )
    finally:
        for proc in procs.values():
            stop(proc)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    summary = {
        name: {
            key: med(name, key)
            for key in (
                "output_throughput",
                "p50_ttft_ms",
                "p99_ttft_ms",
                "p50_itl_ms",
                "p99_itl_ms",
                "p50_e2el_ms",
            )
        }
        for name in systems
    }
    summary["ratio_output_throughput"] = (
        summary["sluice"]["output_throughput"] / summary["vllm"]["output_throughput"]
    )
    (RESULTS / "throughput-summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
