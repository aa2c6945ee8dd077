"""Shared tenant quotas: what Redis costs against counting in process.

    python bench/state_quotas.py

Starts a `redis-server` of its own (in memory, loopback) and measures:

1. **Quota checks.** One tenant with both limits (max_concurrent, tokens_per_minute). In
   process: `TenantQuotas` check + admit + end, as the scheduler core does them. With Redis:
   `SharedQuotas.acquire` (the Lua script's round trip) + `release` (sent without waiting).
   Latency of one check, one at a time (p50/p99/max), and checks per second with 1 and 32
   tasks checking at once in one event loop.
2. **Added latency per request.** Two sim-engine Sluice servers, one with `--state-url`, one
   without, sent the same short chats (one token) one at a time, alternately. The generation
   starts once both the scheduler has dispatched it and its lease is taken, so the lease's
   round trip shows in each response's `timings.time_to_first_token_s`: p50/p99 of each, and
   their difference.

The issue's goal: under 1 ms p99 added per request on localhost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.core.config import StateConfig, TenantConfig  # noqa: E402
from server.core.stats import quantile  # noqa: E402
from server.observability.metrics import Metrics  # noqa: E402
from server.scheduler.quotas import TenantQuotas  # noqa: E402
from server.scheduler.types import Ticket, TrafficClass  # noqa: E402
from server.state.backend import RedisState  # noqa: E402
from server.state.quotas import SharedQuotas  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from overload import free_port  # noqa: E402

TENANT = TenantConfig(name="acme", max_concurrent=1_000_000, tokens_per_minute=10**12)


def ticket(i: int) -> Ticket:
    return Ticket(f"r{i}", "acme", TrafficClass.INTERACTIVE, "m", 0.0, 1e9, 100, 100)


def summary(seconds: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(quantile(seconds, 0.5) * 1000, 4),
        "p99_ms": round(quantile(seconds, 0.99) * 1000, 4),
        "max_ms": round(max(seconds) * 1000, 4),
    }


def in_process(count: int) -> dict[str, Any]:
    quotas = TenantQuotas({"acme": TENANT})
    latencies = []
    started = time.perf_counter()
    for i in range(count):
        t, now = ticket(i), time.monotonic()
        begun = time.perf_counter()
        assert quotas.check(t, now) is None
        quotas.admitted(t, now)
        latencies.append(time.perf_counter() - begun)
        quotas.ended(t)
    return {"checks_per_s": round(count / (time.perf_counter() - started)), **summary(latencies)}


async def with_redis(url: str, count: int, tasks: int) -> dict[str, Any]:
    quotas = SharedQuotas(RedisState(StateConfig(url=url), Metrics()), {"acme": TENANT})
    await quotas.start()
    assert quotas.up
    latencies: list[float] = []

    async def checker(first: int) -> None:
        for i in range(first, count, tasks):
            begun = time.perf_counter()
            hold = await quotas.acquire(ticket(i))
            latencies.append(time.perf_counter() - begun)
            assert hold is not None and hold.lease is not None
            quotas.release(hold)

    for i in range(200):  # warm: the script loaded, the connections made
        hold = await quotas.acquire(ticket(i))
        assert hold is not None
        quotas.release(hold)
    started = time.perf_counter()
    await asyncio.gather(*(checker(k) for k in range(tasks)))
    elapsed = time.perf_counter() - started
    await quotas.stop()
    await quotas.state.stop()
    return {"tasks": tasks, "checks_per_s": round(count / elapsed), **summary(latencies)}


@contextlib.contextmanager
def redis_server(work: Path) -> Iterator[str]:
    """A `redis-server` of the benchmark's own (loopback, in memory), by its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run scripts/install-test-deps.sh")
    port = free_port()
    redis = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(work),
        ],
        stdout=subprocess.DEVNULL,
        process_group=0,
    )
    try:
        wait_for_redis(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        redis.terminate()
        redis.wait(timeout=10)


def wait_for_redis(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                if connection.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)  # polling for it to listen
    raise RuntimeError("redis-server did not start")


def start_sluice(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--engine",
            "sim",
            "--port",
            str(port),
            "--data-dir",
            tempfile.mkdtemp(prefix="sluice-bench-"),
            *args,
        ],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"sluice did not start: {log.read_text()[-2000:]}")


def end_to_end(redis_url: str, requests: int, work: Path) -> dict[str, Any]:
    config = work / "sluice.yaml"
    config.write_text("tenants:\n  acme: {api_keys: [acme-key], max_concurrent: 1000}\n")
    local, local_url = start_sluice(["--config", str(config)], work / "local.log")
    shared, shared_url = start_sluice(
        ["--config", str(config), "--state-url", redis_url], work / "shared.log"
    )
    ttfts: dict[str, list[float]] = {"in_process": [], "redis": []}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        with httpx.Client(headers={"Authorization": "Bearer acme-key"}, timeout=30) as client:
            for i in range(requests + 100):
                for name, url in (("in_process", local_url), ("redis", shared_url)):
                    reply = client.post(url + "/v1/chat/completions", json=chat)
                    reply.raise_for_status()
                    if i >= 100:  # the first hundred warm both up
                        ttfts[name].append(reply.json()["timings"]["time_to_first_token_s"])
    finally:
        for process in (local, shared):
            process.terminate()
            process.wait(timeout=30)
    return {
        "requests": requests,
        **{f"ttft_{name}": summary(values) for name, values in ttfts.items()},
        "added_p50_ms": round(
            (quantile(ttfts["redis"], 0.5) - quantile(ttfts["in_process"], 0.5)) * 1000, 4
        ),
        "added_p99_ms": round(
            (quantile(ttfts["redis"], 0.99) - quantile(ttfts["in_process"], 0.99)) * 1000, 4
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "state-quotas.json"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sluice-state-bench-"))
    with redis_server(work) as url:
        report = {
            "in_process": in_process(args.checks),
            "redis": [asyncio.run(with_redis(url, args.checks, tasks)) for tasks in (1, 32)],
            "end_to_end": end_to_end(url, args.requests, work),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
