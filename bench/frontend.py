"""The frontend's cost: what Sluice streams per second against the framework's floor, in one run.

Each system serves in a subprocess of its own, in turn, on a socket bound here; this process
opens `--streams` (256) streams at once, each asking for `--tokens` (500) tokens, reads them
with raw sockets that only count (an SSE event is `data: {`, a WebSocket one `{"type":"delta"`),
and reports
tokens/s, events/s, the first event's latency (p50/p99 from the request being written) and the
server process's CPU per token (user and system apart):

* floor: a bare uvicorn ASGI app (same loop and HTTP parser as Sluice) that writes the same
  OpenAI chunks, one per token, yielding to the loop between tokens, and nothing else;
* framework: the same chunks from a Starlette app, streamed by Starlette's `StreamingResponse`
  (its task group: the stream and the disconnect listener) and over Starlette's `WebSocket`:
  what the library Sluice is built on costs by itself, per stream and per event;
* sluice: `sluice serve` on the `sim` engine at near-zero step cost (0.2 ms a step, 512 seats),
  so what is measured is the frontend: scheduler, run, log, encoder, transport. The engine
  keeps its own clock (`--sim-catch-up-steps`, `--catch-up-steps` here: 16), as an engine in
  its own process does: when the server is busy, tokens wait for it, and its readers send
  them merged (coalescing under backlog). An engine inside the server's loop would otherwise
  wait for the loop, and no stream could ever fall behind it;
* sluice-1: one token per event forced: the engine waits for the loop (no catch-up) and
  `--stream-coalesce off`, so every token is an event of its own whatever the backlog;
* before: the sluice row's server from another checkout (`--old-root`), measured beside it.

    python bench/frontend.py                         # SSE and WebSocket, every system
    python bench/frontend.py --transports sse --systems floor,sluice --streams 64
    python bench/frontend.py --systems floor,sluice --root /tmp/old   # an older checkout
    python bench/frontend.py --root /tmp/old --catch-up-steps 0   # one without the flag
    python bench/frontend.py --transports sse --tokens 2 --systems floor,framework,sluice \
        --old-root /tmp/old --rounds 5   # per request, before and after, medians of 5 rounds

A warm-up round (`--warmup` streams) precedes each measured one. With `--rounds` every system
is measured once a round, in turn, and the medians of the rounds are reported last. On 2 cores
the client and the server share the machine: compare systems within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from server.core.stats import quantile

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [
    "--engine", "sim", "--sim-step-base-ms", "0.2", "--sim-decode-ms-per-token", "0",
    "--sim-prefill-ms-per-token", "0", "--sim-max-num-seqs", "512", "--sim-kv-blocks", "8192",
]  # fmt: skip
SYSTEMS = {
    "floor": None,
    "framework": None,
    "sluice": [],
    "sluice-1": ["--stream-coalesce", "off"],
    "before": [],  # the sluice row, served from `--old-root`
}
COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


# -- the floor: a bare ASGI app writing the same chunks ---------------------------------------


# The chunks both bare apps write, as Sluice's encoder renders them.
HEAD = (
    b'data: {"id":"chatcmpl-floor","object":"chat.completion.chunk","created":1,'
    b'"model":"sluice-demo","choices":[{"index":0,'
)
SUFFIX = b'},"logprobs":null,"finish_reason":null}]}\n\n'
ROLE = HEAD + b'"delta":{"role":"assistant","content":""' + SUFFIX
PREFIX = HEAD + b'"delta":{"content":'
FINISH = HEAD + b'"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'


def floor_app():  # type: ignore[no-untyped-def]
    import orjson

    role, prefix, suffix, finish = ROLE, PREFIX, SUFFIX, FINISH

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] == "websocket":
            await receive()  # connect
            await send({"type": "websocket.accept"})
            message = orjson.loads((await receive())["text"])
            tokens, gen = message["request"]["max_tokens"], message["id"]
            for seq in range(1, tokens + 1):
                text = orjson.dumps(
                    {"type": "delta", "id": gen, "seq": seq, "text": " tok", "tokens": 1}
                ).decode()
                await send({"type": "websocket.send", "text": text})
                await asyncio.sleep(0)
            usage = {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": tokens + 2}
            final = {"type": "final", "id": gen, "seq": tokens + 1, "finish_reason": "length"}
            text = orjson.dumps({**final, "usage": usage}).decode()
            await send({"type": "websocket.send", "text": text})
            await receive()  # the client closes
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        tokens = orjson.loads(body)["max_tokens"]
        await send(
            {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]}
        )  # fmt: skip
        await send({"type": "http.response.body", "body": role, "more_body": True})
        for _ in range(tokens):
            chunk = prefix + orjson.dumps(" tok") + suffix
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(0)
        usage = b'{"completion_tokens":%d}' % tokens
        await send({"type": "http.response.body", "body": finish, "more_body": True})
        end = b'data: {"choices":[],"usage":' + usage + b"}\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": end, "more_body": False})

    return app


def framework_app():  # type: ignore[no-untyped-def]
    """The floor's chunks through Starlette's StreamingResponse and WebSocket."""
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket

    async def chat(request: Request) -> StreamingResponse:
        tokens = orjson.loads(await request.body())["max_tokens"]

        async def chunks():  # type: ignore[no-untyped-def]
            yield ROLE
            for _ in range(tokens):
                yield PREFIX + orjson.dumps(" tok") + SUFFIX
                await asyncio.sleep(0)
            yield FINISH
            usage = b'{"completion_tokens":%d}' % tokens
            yield b'data: {"choices":[],"usage":' + usage + b"}\n\ndata: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        message = orjson.loads(await websocket.receive_text())
        tokens, gen = message["request"]["max_tokens"], message["id"]
        for seq in range(1, tokens + 1):
            text = orjson.dumps(
                {"type": "delta", "id": gen, "seq": seq, "text": " tok", "tokens": 1}
            ).decode()
            await websocket.send_text(text)
            await asyncio.sleep(0)
        usage = {"prompt_tokens": 2, "completion_tokens": tokens, "total_tokens": tokens + 2}
        final = {"type": "final", "id": gen, "seq": tokens + 1, "finish_reason": "length"}
        await websocket.send_text(orjson.dumps({**final, "usage": usage}).decode())
        await websocket.receive()  # the client closes

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), WebSocketRoute("/v1/ws", ws)]
    )


def serve_floor(fd: int, kind: str) -> None:
    import uvicorn

    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    app = floor_app() if kind == "floor" else framework_app()
    uvicorn.Server(uvicorn.Config(app, fd=fd, log_level="warning", access_log=False)).run()


# -- the client --------------------------------------------------------------------------------


@dataclass
class Stream:
    first_event_s: float
    events: int
    tokens: int


class Counter(asyncio.Protocol):
    """Reads one stream's bytes and counts events in them, without parsing anything: the
    bytes before the events (HTTP headers) are skipped, and the stream ends at `end`."""

    def __init__(self, request: bytes, event: bytes, end: bytes, then: bytes = b"") -> None:
        """`then`: written once the response's head has come (a WebSocket's first message)."""
        self.request, self.event, self.end, self.then = request, event, end, then
        self.started = 0.0
        self.first: float | None = None
        self.events = 0
        self.tail = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.started = time.monotonic()
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        # (the carried bytes are shorter than an event: one split across reads counts once)
        carried = self.tail[1 - len(self.event) :] + data
        found = carried.count(self.event)
        if found and self.first is None:
            self.first = time.monotonic() - self.started
        self.events += found
        self.tail = (self.tail + data)[-4096:]
        if self.then and b"\r\n\r\n" in self.tail:
            self.transport.write(self.then)  # type: ignore[attr-defined]
            self.then = b""
        if self.end in self.tail and not self.done.done():
            self.done.set_result(None)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            ended = ConnectionError(f"the stream ended early: {self.tail[-300:]!r}")
            self.done.set_exception(ended)


async def one_stream(
    port: int, request: tuple[bytes, bytes], event: bytes, end: bytes, skip: int
) -> Stream:
    loop = asyncio.get_running_loop()
    _, counter = await loop.create_connection(
        lambda: Counter(request[0], event, end, request[1]), "127.0.0.1", port
    )
    await counter.done
    counted = COMPLETION_TOKENS.findall(counter.tail)
    assert counter.first is not None and counted, f"no usage in {counter.tail[-300:]!r}"
    return Stream(counter.first, counter.events - skip, int(counted[-1]))


def sse_request(
    tokens: int, model: str | None = None, deadline_ms: int | None = None
) -> tuple[bytes, bytes]:
    named = b'"model":"%s",' % model.encode() if model else b""
    body = (
        b'{%s"messages":[{"role":"user","content":"hi"}],"max_tokens":%d,"ignore_eos":true,'
        b'"stream":true,"stream_options":{"include_usage":true}}' % (named, tokens)
    )
    deadline = b"" if deadline_ms is None else b"\r\nX-Request-Timeout-Ms: %d" % deadline_ms
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
        b"%s\r\nContent-Length: %d\r\n\r\n%s" % (deadline, len(body), body),
        b"",
    )


def ws_request(tokens: int) -> tuple[bytes, bytes]:
    """The upgrade; once accepted, the generate message as one masked text frame (mask 0:
    the bytes stay as they are)."""
    message = (
        b'{"type":"generate","id":"b","request":{"messages":[{"role":"user","content":"hi"}],'
        b'"max_tokens":%d,"ignore_eos":true}}' % tokens
    )
    size = len(message)
    length = bytes([0x80 | size]) if size < 126 else b"\xfe" + size.to_bytes(2, "big")
    frame = b"\x81" + length + b"\0\0\0\0" + message
    return (
        b"GET /v1/ws HTTP/1.1\r\nHost: bench\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        frame,
    )


async def load(
    transport: str,
    port: int,
    streams: int,
    tokens: int,
    model: str | None = None,
    deadline_ms: int | None = None,
) -> list[Stream]:
    """`streams` streams at once, each of `tokens` tokens (of `model`: the server's default
    when None), read to their ends; over SSE, each asking for `deadline_ms` (Sluice's
    `X-Request-Timeout-Ms`) when given."""
    if transport == "sse":  # (the role, finish and usage chunks are events, not tokens)
        request = sse_request(tokens, model, deadline_ms)
        event, end, skip = b"data: {", b"data: [DONE]", 3
    else:
        request, event, end, skip = ws_request(tokens), b'{"type":"delta"', b'"type":"final"', 0
    return await asyncio.gather(
        *(one_stream(port, request, event, end, skip) for _ in range(streams))
    )


# -- the run -----------------------------------------------------------------------------------


def start(
    system: str, listener: socket.socket, data: str, root: Path, catch_up: int
) -> subprocess.Popen[bytes]:
    extra = SYSTEMS[system]
    if system in ("sluice", "before") and catch_up:
        extra = [*extra, "--sim-catch-up-steps", str(catch_up)]
    fd = str(listener.fileno())
    command = (
        [sys.executable, __file__, "--floor-fd", fd, "--floor-kind", system]
        if extra is None
        else [sys.executable, "-m", "server.cli", "serve", "--fd", fd, "--data-dir", data,
              "--log-level", "warning", *ENGINE, *extra]
    )  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT if extra is None else root, stdout=subprocess.DEVNULL, process_group=0,
        pass_fds=[listener.fileno()],
    )  # fmt: skip


def ready(port: int, server: subprocess.Popen[bytes], system: str) -> None:
    url = f"http://127.0.0.1:{port}/ready"
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"{system} exited with {server.returncode}")
        try:
            if SYSTEMS[system] is None or httpx.get(url).status_code == 200:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)  # start-up polling interval
    raise SystemExit(f"{system} was not ready in 60 s")


def measure(args: argparse.Namespace, system: str, transport: str) -> dict[str, float]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    port = int(listener.getsockname()[1])
    with tempfile.TemporaryDirectory() as data, listener:
        root = args.old_root if system == "before" else args.root
        server = start(system, listener, data, root, args.catch_up_steps)
        try:
            ready(port, server, system)
            process = psutil.Process(server.pid)
            asyncio.run(load(transport, port, args.warmup, args.tokens))
            before, started = process.cpu_times(), time.monotonic()
            results = asyncio.run(load(transport, port, args.streams, args.tokens))
            took = time.monotonic() - started
            after = process.cpu_times()
        finally:
            server.terminate()
            server.wait(30)
    user, system = after.user - before.user, after.system - before.system
    tokens = sum(r.tokens for r in results)
    events = sum(r.events for r in results)
    firsts = [r.first_event_s for r in results]
    assert tokens == args.streams * args.tokens, f"{tokens} tokens streamed"
    return {
        "tokens_per_s": tokens / took,
        "events_per_s": events / took,
        "tokens_per_event": tokens / events,
        "first_p50_ms": 1e3 * statistics.median(firsts),
        "first_p99_ms": 1e3 * quantile(firsts, 0.99),
        "cpu_us_per_token": 1e6 * (user + system) / tokens,
        # (on loopback the kernel's side of each write, the receiver's wake-up among it, is
        # the sender's system time: how writes bunch up shows there)
        "user_us_per_token": 1e6 * user / tokens,
        "system_us_per_token": 1e6 * system / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=16, help="streams of the warm-up round")
    parser.add_argument("--transports", default="sse,ws")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the checkout whose Sluice is served (an older one)"
    )
    parser.add_argument(
        "--catch-up-steps",
        type=int,
        default=16,
        help="the 'sluice' row's --sim-catch-up-steps (0: not passed, for older checkouts)",
    )
    parser.add_argument(
        "--old-root", type=Path, help="also serve this checkout's Sluice (an older one): 'before'"
    )
    parser.add_argument("--rounds", type=int, default=1, help="every system once a round")
    parser.add_argument("--floor-fd", type=int, help=argparse.SUPPRESS)  # serve the floor
    parser.add_argument("--floor-kind", default="floor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_fd is not None:
        serve_floor(args.floor_fd, args.floor_kind)
        return
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    print(f"{args.streams} streams x {args.tokens} tokens")
    header = (
        f"{'transport':9} {'system':10} {'tokens/s':>9} {'events/s':>9} {'tok/event':>9} "
        f"{'first p50':>9} {'first p99':>9} {'CPU µs/token':>12} {'user/sys':>11} "
        f"{'x floor tok/s':>13} {'p99 x floor':>11} {'p99 x frame':>11}"
    )
    print(header)
    systems = args.systems.split(",")
    if args.old_root is not None and "before" not in systems:
        systems.append("before")
    for transport in args.transports.split(","):
        rounds: dict[str, list[dict[str, float]]] = {system: [] for system in systems}
        for round_no in range(args.rounds):
            for system in systems:
                rounds[system].append(measure(args, system, transport))
                print(row(transport, system, rounds[system][-1], rounds, round_no), flush=True)
        if args.rounds > 1:
            print(f"medians of {args.rounds} rounds:")
            medians = {
                system: [{k: statistics.median(r[k] for r in results) for k in results[0]}]
                for system, results in rounds.items()
            }
            for system in systems:
                print(row(transport, system, medians[system][0], medians, 0), flush=True)


def row(
    transport: str,
    system: str,
    r: dict[str, float],
    rounds: dict[str, list[dict[str, float]]],
    round_no: int,
) -> str:
    """One system's figures, against the floor and the framework of the same round."""

    def against(other: str, key: str) -> str:
        results = rounds.get(other, [])
        if len(results) <= round_no:
            return "-"
        return f"{r[key] / results[round_no][key]:.2f}x"

    return (
        f"{transport:9} {system:10} {r['tokens_per_s']:9.0f} {r['events_per_s']:9.0f} "
        f"{r['tokens_per_event']:9.2f} {r['first_p50_ms']:7.1f}ms "
        f"{r['first_p99_ms']:7.1f}ms "
        f"{r['cpu_us_per_token']:12.1f} "
        f"{r['user_us_per_token']:5.1f}/{r['system_us_per_token']:<5.1f} "
        f"{against('floor', 'tokens_per_s'):>13} {against('floor', 'first_p99_ms'):>11} "
        f"{against('framework', 'first_p99_ms'):>11}"
    )


if __name__ == "__main__":
    main()
