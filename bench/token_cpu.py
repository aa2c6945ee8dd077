"""Server CPU per streamed token: `sluice serve --engine sim` at near-zero step cost in a
subprocess, 64 concurrent SSE streams of 500 tokens read by raw sockets that only count events.

    python bench/token_cpu.py                  # this checkout
    python bench/token_cpu.py --root /tmp/old --port 8311  # another checkout (an older one)
    python bench/token_cpu.py --otlp           # tracing on: spans to a receiver in this process
    python bench/token_cpu.py --against /work/main --rounds 20  # this and another, round by round

Each round prints the events read, their rate, and the server process's CPU time (user +
system) per event. Run two checkouts alternately, several rounds each: on 2 cores one round
varies by ±20%. `--against` serves a second checkout beside this one and alternates the
rounds, each round of this one followed by one of the other, and prints their ratios: both see
the same load from the rest of a busy host. With `--otlp`, each stream to this checkout carries
a sampled `traceparent` and the server exports a span per stream (OTLP/HTTP) to a receiver in
this process, which counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
from checkouts import ROOT, checkout, served_from

ENGINE = [
    "--engine", "sim", "--sim-step-base-ms", "0.2", "--sim-decode-ms-per-token", "0",
    "--sim-prefill-ms-per-token", "0", "--sim-max-num-seqs", "512", "--sim-kv-blocks", "8192",
]  # fmt: skip


async def stream(port: int, tokens: int, traced: bool) -> int:
    """One streamed chat, read to `[DONE]`; the number of chunk events. `traced`: sent with a
    sampled traceparent of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = (
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":%d,'
        b'"ignore_eos":true,"stream":true}' % tokens
    )
    trace = b""
    if traced:
        trace = b"traceparent: 00-%s-%s-01\r\n" % (
            secrets.token_hex(16).encode(),
            secrets.token_hex(8).encode(),
        )
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        b"\r\n%sContent-Length: %d\r\n\r\n%s" % (trace, len(body), body)
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
    parser.add_argument("--root", type=checkout, default=ROOT, help="the checkout to serve")
    parser.add_argument(
        "--port",
        type=int,
        help="serve on this port (a checkout before `serve --fd`); else on "
        "a socket bound here and inherited",
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--otlp",
        action="store_true",
        help="tracing on (--root's server): it exports a span per stream (OTLP/HTTP) to a "
        "receiver here, each stream sent with a traceparent",
    )
    parser.add_argument(
        "--against",
        type=checkout,
        help="also serve this checkout (one with `serve --fd`, without tracing) and alternate "
        "the rounds between the two servers, so that both see the same load from the rest "
        "of the host; prints each round's ratio",
    )
    args = parser.parse_args()
    receiver = SpanCounter() if args.otlp else None
    with contextlib.ExitStack() as stack:
        measured = stack.enter_context(served(args.root, args.port, receiver))
        other = None if args.against is None else stack.enter_context(served(args.against))
        ratios = []
        for round_ in range(args.rounds):
            ours = measure(measured, args.streams, args.tokens, traced=receiver is not None)
            line = f"round {round_}: {ours}"
            if other is not None:
                theirs = measure(other, args.streams, args.tokens, traced=False)
                ratios.append(ours.cpu_per_event / theirs.cpu_per_event)
                line += f" | against: {theirs} | ratio {ratios[-1]:.3f}"
            print(line, flush=True)
        if ratios:
            print(f"median ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds")
    if receiver is not None:  # (the server sends what it holds as it stops)
        print(f"spans received: {receiver.spans} (streams: {args.streams * args.rounds})")


@dataclass(frozen=True)
class Server:
    port: int
    process: psutil.Process


@dataclass(frozen=True)
class Round:
    events: int
    seconds: float
    cpu_s: float

    @property
    def cpu_per_event(self) -> float:
        return self.cpu_s / self.events

    def __str__(self) -> str:
        return (
            f"{self.events} events, {self.events / self.seconds:.0f}/s, "
            f"server CPU {1e6 * self.cpu_per_event:.1f} µs/event"
        )


@contextlib.contextmanager
def served(
    root: Path, port: int | None = None, receiver: SpanCounter | None = None
) -> Iterator[Server]:
    """`sluice serve --engine sim` from checkout `root`, ready; stopped on leaving. On a
    socket bound here and inherited (`--fd`), or on `port` (a checkout before `--fd`)."""
    listener = socket.create_server(("127.0.0.1", 0)) if port is None else None
    if listener is None:
        where, fds = ["--port", str(port)], []
    else:
        port, where, fds = (
            int(listener.getsockname()[1]),
            ["--fd", str(listener.fileno())],
            [listener],
        )
    tracing, env = [], dict(os.environ)
    if receiver is not None:
        tracing = ["--otlp-traces-endpoint", receiver.url]
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    with tempfile.TemporaryDirectory() as data, contextlib.ExitStack() as closing:
        for fd in fds:
            closing.enter_context(fd)
        server = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", *where,
             "--data-dir", data, "--log-level", "warning", *ENGINE, *tracing],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0,
            pass_fds=[fd.fileno() for fd in fds], **served_from(root, env),
        )  # fmt: skip
        try:
            ready(f"http://127.0.0.1:{port}/ready", server)
            yield Server(port, psutil.Process(server.pid))
        finally:
            server.terminate()
            server.wait(30)


def measure(server: Server, count: int, tokens: int, *, traced: bool) -> Round:
    """One round: `count` streams of `tokens` at once, and the server's CPU time meanwhile."""
    cpu, started = sum(server.process.cpu_times()[:2]), time.monotonic()
    events = sum(asyncio.run(streams(server.port, count, tokens, traced)))
    cpu, took = sum(server.process.cpu_times()[:2]) - cpu, time.monotonic() - started
    return Round(events, took, cpu)


async def streams(port: int, count: int, tokens: int, traced: bool) -> list[int]:
    return await asyncio.gather(*(stream(port, tokens, traced) for _ in range(count)))


class SpanCounter:
    """An OTLP/HTTP receiver on loopback that counts the spans it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.spans = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                counter.spans += sum(
                    len(scope.spans)
                    for spans in request.resource_spans
                    for scope in spans.scope_spans
                )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        threading.Thread(target=server.serve_forever, daemon=True).start()


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
