"""Server CPU per streamed token: `sluice serve --engine sim` at near-zero step cost in a
subprocess, 64 concurrent SSE streams of 500 tokens read by raw sockets that only count events.

    python bench/token_cpu.py                  # this checkout
    python bench/token_cpu.py --root /tmp/old --port 8311  # another checkout (an older one)

Each round prints the events read, their rate, and the server process's CPU time (user +
system) per event. Run two checkouts alternately, several rounds each: on 2 cores one round
varies by ±20%.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [
    "--engine", "sim", "--sim-step-base-ms", "0.2", "--sim-decode-ms-per-token", "0",
    "--sim-prefill-ms-per-token", "0", "--sim-max-num-seqs", "512", "--sim-kv-blocks", "8192",
]  # fmt: skip


async def stream(port: int, tokens: int) -> int:
    """One streamed chat, read to `[DONE]`; the number of chunk events."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":%d,'
        b'"ignore_eos":true,"stream":true}' % tokens
    )
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    events, tail = 0, b""
    while chunk := await reader.read(65536):
        events += chunk.count(b"data: {")
        tail = (tail + chunk)[-32:]
        if b"data: [DONE]" in tail:
            break
    writer.close()
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to serve")
    parser.add_argument(
        "--port",
        type=int,
        help="serve on this port (a checkout before `serve --fd`); else on "
        "a socket bound here and inherited",
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    listener = socket.create_server(("127.0.0.1", 0))  # the server inherits it (--fd)
    port, where, fds = int(listener.getsockname()[1]), ["--fd", str(listener.fileno())], [listener]
    if args.port is not None:
        port, where, fds = args.port, ["--port", str(args.port)], []
    with tempfile.TemporaryDirectory() as data, listener:
        server = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", *where,
             "--data-dir", data, "--log-level", "warning", *ENGINE],
            cwd=args.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            process_group=0, pass_fds=[fd.fileno() for fd in fds],
        )  # fmt: skip
        try:
            ready(f"http://127.0.0.1:{port}/ready", server)
            process = psutil.Process(server.pid)
            for round_ in range(args.rounds):
                cpu, started = sum(process.cpu_times()[:2]), time.monotonic()
                counts = asyncio.run(streams(port, args.streams, args.tokens))
                cpu, took = sum(process.cpu_times()[:2]) - cpu, time.monotonic() - started
                events = sum(counts)
                print(
                    f"round {round_}: {events} events, {events / took:.0f}/s, "
                    f"server CPU {1e6 * cpu / events:.1f} µs/event"
                )
        finally:
            server.terminate()
            server.wait(30)


async def streams(port: int, count: int, tokens: int) -> list[int]:
    return await asyncio.gather(*(stream(port, tokens) for _ in range(count)))


def ready(url: str, server: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(url).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # start-up polling interval
    raise SystemExit("the server was not ready in 60 s")


if __name__ == "__main__":
    main()
