"""A 10,000-line batch on the sim engine while chats arrive.

Three phases on one Sluice process (sim engine), chats arriving at `--chat-rate` per second
throughout each:
1. chats alone: their time to first token (TTFT) p50/p99;
2. a `--lines`-line batch running (the Batch API): the chats' TTFT, and the batch's lines/s
   (completed lines over the phase, from its request_counts);
3. the same lines sent as plain bulk requests (`X-Traffic-Class: bulk`, not streamed) by a load
   generator in its own process, as many at once as the batch runner keeps in the scheduler:
   the chats' TTFT and the lines/s.

Goals (issue "Bulk jobs that survive restarts"): chats' TTFT p99 with the batch within 2x of
without; the batch's lines/s at least 0.9x of plain bulk's.

    python bench/batch.py [--lines 10000] [--seconds 20] [--chat-rate 4]
"""

from __future__ import annotations

import argparse
import asyncio
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

from server.core.stats import quantile

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 64  # the batch runner's lines in the scheduler at once (server/batch_api/runner.py)
LINE = {"max_tokens": 32, "ignore_eos": True}

BULK_CLIENT = r"""
import asyncio, json, sys, time
import httpx
url, concurrency, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
body = json.loads(sys.argv[4])
async def worker(client, stop, done):
    i = 0
    while time.monotonic() < stop:
        r = await client.post("/v1/chat/completions", content=body, headers={
            "Content-Type": "application/json", "X-Traffic-Class": "bulk"})
        if r.status_code == 200 and time.monotonic() < stop:
            done.append(1)
async def main():
    done = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(worker(client, stop, done) for _ in range(concurrency)))
    print(len(done))
body = json.dumps(body)
asyncio.run(main())
"""


async def chats(url: str, rate: float, seconds: float) -> list[float]:
    """Streamed chats at `rate` per second for `seconds`: each one's TTFT (to its first
    generated text), in seconds."""
    ttfts: list[float] = []

    async def one(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        body = {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {") and '"content":""' not in line:
                    ttfts.append(time.perf_counter() - start)
                    break
            async for _ in lines:
                pass

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = []
        for _ in range(int(rate * seconds)):
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(1 / rate)  # the arrival schedule
        await asyncio.gather(*tasks)
    return ttfts


def batch_lines(count: int) -> bytes:
    return "".join(
        json.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {**LINE, "messages": [{"role": "user", "content": f"question {i}"}]},
            }
        )
        + "\n"
        for i in range(count)
    ).encode()


def completed(url: str, batch_id: str) -> int:
    return int(httpx.get(f"{url}/v1/batches/{batch_id}").json()["request_counts"]["completed"])


def run(args: argparse.Namespace, url: str) -> dict[str, object]:
    report: dict[str, object] = {}
    alone = asyncio.run(chats(url, args.chat_rate, args.seconds))
    report["chats alone"] = alone

    upload = httpx.post(
        f"{url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("lines.jsonl", batch_lines(args.lines))},
        timeout=60,
    )
    batch = httpx.post(
        f"{url}/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    time.sleep(2)  # settling: the batch fills its window before the measurement starts
    before, started = completed(url, batch["id"]), time.monotonic()
    with_batch = asyncio.run(chats(url, args.chat_rate, args.seconds))
    report["batch lines/s"] = (completed(url, batch["id"]) - before) / (time.monotonic() - started)
    report["chats with the batch"] = with_batch
    httpx.post(f"{url}/v1/batches/{batch['id']}/cancel")

    bulk = subprocess.Popen(
        [
            sys.executable,
            "-c",
            BULK_CLIENT,
            url,
            str(WINDOW),
            str(args.seconds + 2),
            json.dumps({**LINE, "messages": [{"role": "user", "content": "question 1"}]}),
        ],
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    time.sleep(2)  # settling, as for the batch
    with_bulk = asyncio.run(chats(url, args.chat_rate, args.seconds))
    out, _ = bulk.communicate(timeout=600)
    report["bulk lines/s"] = int(out.strip()) / (args.seconds + 2)
    report["chats with plain bulk"] = with_bulk
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--chat-rate", type=float, default=4.0)
    parser.add_argument("--port", type=int, default=8311)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--engine",
                "sim",
                "--port",
                str(args.port),
                "--log-level",
                "warning",
                "--data-dir",
                data,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            process_group=0,
        )
        url = f"http://127.0.0.1:{args.port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(url + "/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)  # start-up polling
            report = run(args, url)
        finally:
            os.killpg(server.pid, signal.SIGTERM)  # drains, then exits 0
            server.wait(timeout=60)
    summary = {}
    for name in ("chats alone", "chats with the batch", "chats with plain bulk"):
        ttfts = report[name]
        assert isinstance(ttfts, list)
        summary[name] = {
            "count": len(ttfts),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
            "ttft_p99_ms": round(quantile(ttfts, 0.99) * 1000, 1),
        }
    alone_p99 = summary["chats alone"]["ttft_p99_ms"]
    summary["ttft p99 with the batch / alone"] = round(
        summary["chats with the batch"]["ttft_p99_ms"] / alone_p99, 2
    )
    summary["batch lines/s"] = round(float(report["batch lines/s"]), 1)  # type: ignore[arg-type]
    summary["plain bulk lines/s"] = round(float(report["bulk lines/s"]), 1)  # type: ignore[arg-type]
    summary["batch / plain bulk"] = round(
        summary["batch lines/s"] / summary["plain bulk lines/s"], 2
    )  # type: ignore[operator]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
