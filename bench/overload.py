"""Overload at 10x capacity: honest refusals, kept promises, flat memory, no leaked budget.

One command per engine:

    python bench/overload.py --engine sim
    python bench/overload.py --engine vllm          # the demo model on vLLM (CPU)

1. Measure capacity: `--probe-streams` closed-loop clients for `--probe-seconds`; completed
   requests per second is the capacity.
2. Offer 10x that as a Poisson process for `--duration` seconds, every request with
   `X-Request-Timeout-Ms: --deadline-ms` (non-streamed chat completions of `--max-tokens`).
3. Check and report: every admitted request completed within its deadline or was expired at it
   (504 deadline_exceeded), by the server's clock (access log) and by the client's; refusals
   (429/503) answered within 10 ms, measured by the server (its access log's duration for each
   refused request) and by the client; server RSS sampled every second stays flat; after the
   load, budgets in use and queue depth return to zero.

The load generator speaks HTTP/1.1 on raw loopback sockets (one connection per request, the
whole request in one write): an httpx client at 3,000 open connections lagged so far behind
that request bodies reached the server seconds late.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server.core.stats import quantile

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def post(port: int, body: bytes, deadline_ms: int, request_id: str) -> tuple[int, bytes]:
    """One non-streamed POST on its own loopback connection, with no client library: the load
    generator shares two cores with the server, so every microsecond it spends is the server's
    loss. The whole request goes out in one write, so the server never waits for a body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nX-Request-Timeout-Ms: %d\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (deadline_ms, request_id.encode(), len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        payload = await (reader.readexactly(int(length.group(1))) if length else reader.read())
        return status, payload
    finally:
        writer.close()


_SEQUENCE = itertools.count()


async def one(port: int, body: bytes, deadline_ms: int, log: list, phase: str) -> None:
    """One request; its id names its phase ("probe" or "overload") in the server's log."""
    start = time.monotonic()
    try:
        status, payload = await post(port, body, deadline_ms, f"{phase}-{next(_SEQUENCE)}")
        code = "ok" if status == 200 else json.loads(payload)["error"]["code"]
        log.append((status, code, time.monotonic() - start))
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        log.append((0, type(exc).__name__, time.monotonic() - start))


async def run(args: argparse.Namespace, url: str, pid: int) -> dict:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "summarise the incident report"}],
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
        }
    ).encode()
    port = args.port
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        probe: list = []
        stop_at = time.monotonic() + args.probe_seconds

        async def closed_loop() -> None:
            while time.monotonic() < stop_at:
                await one(port, body, 600_000, probe, "probe")

        await asyncio.gather(*(closed_loop() for _ in range(args.probe_streams)))
        done = sum(1 for status, _, _ in probe if status == 200)
        capacity = done / args.probe_seconds
        rate = capacity * args.overload
        rng = random.Random(0)
        log: list = []
        rss: list[float] = [rss_mib(pid)]
        tasks = []
        started = time.monotonic()
        next_rss = started + 1
        arrival = started
        while arrival - started < args.duration:
            # Arrivals on an absolute Poisson schedule: a late client catches up, not drifts.
            arrival += rng.expovariate(rate)
            delay = arrival - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(port, body, args.deadline_ms, log, "overload")))
            if time.monotonic() >= next_rss:
                rss.append(rss_mib(pid))
                next_rss += 1
        await asyncio.gather(*tasks)
        rss.append(rss_mib(pid))
        for _ in range(100):  # the server settles: nothing queued, nothing held
            text = (await client.get("/metrics")).text
            settled = metric(text, "sluice_budget_in_use") + metric(text, "sluice_queue_depth")
            if settled == 0:
                break
            await asyncio.sleep(0.1)
    by_code: dict[str, int] = {}
    for status, code, _ in log:
        by_code[f"{status} {code}"] = by_code.get(f"{status} {code}", 0) + 1
    completed = [d for status, _, d in log if status == 200]
    refused = [d for status, _, d in log if status in (429, 503)]
    return {
        "capacity_rps": round(capacity, 1),
        "offered_rps": round(rate, 1),
        "offered": len(log),
        "outcomes": by_code,
        "completed_latency_max_s": round(max(completed), 3) if completed else None,
        "completed_after_deadline": sum(1 for d in completed if d > args.deadline_ms / 1000),
        "deadline_s": args.deadline_ms / 1000,
        "client_refusal_ms": {
            "p50": round(1000 * quantile(refused, 0.5), 2) if refused else None,
            "p99": round(1000 * quantile(refused, 0.99), 2) if refused else None,
        },
        "offered_rps_achieved": round(len(log) / args.duration, 1),
        "rss_mib": {
            "start": round(rss[0], 1),
            "max": round(max(rss), 1),
            "end": round(rss[-1], 1),
            "max_first_half": round(max(rss[: len(rss) // 2 or 1]), 1),
            "max_second_half": round(max(rss[len(rss) // 2 :]), 1),
        },
        "after": {
            "budget_in_use": metric(text, "sluice_budget_in_use"),
            "queue_depth": metric(text, "sluice_queue_depth"),
            "engine_unfinished": metric(text, "sluice_engine_unfinished_requests"),
        },
    }


def server_completed_after_deadline(log_path: Path, deadline_s: float) -> dict:
    """Overload-phase completions the server itself timed past the deadline (its access log's
    duration runs from arrival to the last byte handed to the socket). The capacity probe's
    requests have a longer deadline and are left out."""
    durations = [
        json.loads(line)["duration_s"]
        for line in log_path.read_text(errors="replace").splitlines()
        if line.startswith("{")
        and '"outcome":"completed"' in line
        and '"request_id":"overload-' in line
    ]
    late = [d for d in durations if d > deadline_s]
    return {
        "completed": len(durations),
        "late": len(late),
        "max_s": round(max(durations), 3) if durations else None,
    }


def server_refusal_ms(log_path: Path) -> dict:
    durations = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"outcome":"rejected"' in line:
            durations.append(json.loads(line)["duration_s"] * 1000)
    return {
        "count": len(durations),
        "p50": round(statistics.median(durations), 3) if durations else None,
        "p99": round(quantile(durations, 0.99), 3) if durations else None,
        "max": round(max(durations), 3) if durations else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--overload", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--deadline-ms", type=int, default=20000)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--probe-streams", type=int, default=64)
    parser.add_argument("--probe-seconds", type=float, default=20.0)
    parser.add_argument(
        "--port", type=int, default=None, help="port for the server it starts (default: a free one)"
    )
    args = parser.parse_args()
    if args.port is None:
        args.port = free_port()  # a fixed default measured whatever server already held it

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--engine",
        args.engine,
        "--port",
        str(args.port),
        "--log-level",
        "warning",
        "--data-dir",
        tempfile.mkdtemp(prefix="sluice-bench-"),
    ]  # its own batch store
    # A process group but not a new session (see tests/conftest.py: a separate session's
    # autogroup starved this load generator for seconds at a time).
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log_path}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        result = asyncio.run(run(args, url, proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    result["server_refusal_ms"] = server_refusal_ms(log_path)
    result["server_completed"] = server_completed_after_deadline(log_path, args.deadline_ms / 1000)
    result["engine"] = args.engine
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
