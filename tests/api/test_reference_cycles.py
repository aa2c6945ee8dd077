"""However a request ends, its state is freed when it ends, not at the next full GC pass.

A reference cycle through a request (typically: a task keeps its error, whose traceback holds a
frame that holds the task) keeps its connection, timeline and ticket alive until the cyclic
garbage collector runs. Under sustained overload thousands of refused and expired requests
piled up between full passes and the server's memory grew. Each case here runs one way of
ending with the collector off, then asks it what it would have had to free.

A real uvicorn server on loopback in this process (the collector must see its objects), the
sim engine behind it. Only Sluice's per-request objects are counted. A client that leaves
mid-stream is not among the cases: its stream ends by a cancellation, whose error's traceback
holds the frames it passed through.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

import pytest
import uvicorn
import websockets

from engine_adapters.sim import SimEngine
from server.api.app import build_app
from server.api.serving import build_stores
from server.core.config import BudgetConfig, EstimateConfig, SluiceConfig
from server.observability.metrics import Metrics
from server.scheduler.runtime import SchedulerRuntime
from server.scheduler.types import TrafficClass

# Created once per request; in the garbage only if a cycle held the request.
PER_REQUEST_TYPES = {"RequestTimeline", "Ticket", "GenerationRun", "RunResponse"}
# An optimistic prior: long answers are admitted (and then run past short deadlines).
FAST_PRIOR = EstimateConfig(decode_tokens_per_s=100_000.0, calibrate=False)
Server = tuple[int, SchedulerRuntime, SimEngine]  # its port, its scheduler, its engine


async def until(condition: Callable[[], bool], failure: str) -> None:
    """Poll `condition` for up to 5 s."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)  # polling interval, not a stand-in for a condition
    raise AssertionError(failure)


@asynccontextmanager
async def sim_server(config: SluiceConfig) -> AsyncIterator[Server]:
    engine = SimEngine()
    metrics = Metrics()
    runtime = SchedulerRuntime(config, engine, "sim", metrics)
    stores = build_stores(engine, config, metrics)
    app = build_app(engine, runtime, config, "sim", metrics=metrics, stores=stores)
    listener = socket.socket()  # bound here: no free port to race another process for
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = int(listener.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        await until(lambda: server.started, "the server did not start")
        yield port, runtime, engine
        # Every request has ended: no connection open, nothing queued or running.
        await until(
            lambda: not server.server_state.connections and runtime.core.is_idle(),
            "the server did not settle",
        )
    finally:
        server.should_exit = True
        await serving
        listener.close()


@contextmanager
def collector_off() -> Iterator[collections.Counter[str]]:
    """Run the block with the collector off; then count what it would have freed."""
    found: collections.Counter[str] = collections.Counter()
    gc.collect()
    gc.disable()
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.update(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def chat(max_tokens: int, *, stream: bool = False) -> bytes:
    return json.dumps(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
    ).encode()


async def post(
    port: int, body: bytes, timeout_ms: int | None = None, leave: asyncio.Event | None = None
) -> int:
    """Status of one POST on its own connection; 0 if the client left when `leave` was set."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    deadline = b"X-Request-Timeout-Ms: %d\r\n" % timeout_ms if timeout_ms else b""
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (deadline, len(body), body)
        )
        if leave is not None:
            await leave.wait()
            return 0
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.read()
        return int(head.split(b" ", 2)[1])
    finally:
        writer.close()


async def ws_generate(port: int, count: int, max_tokens: int, timeout_ms: int) -> list[str]:
    """Outcomes of `count` generations on one WebSocket (finish reason or error code)."""
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
        for i in range(count):
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": f"g{i}",
                        "timeout_ms": timeout_ms,
                        "request": {
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": max_tokens,
                            "ignore_eos": True,
                        },
                    }
                )
            )
        outcomes: list[str] = []
        while len(outcomes) < count:
            reply = json.loads(await ws.recv())
            if reply["type"] in ("final", "error"):
                outcomes.append(reply.get("finish_reason") or reply["error"]["code"])
        return outcomes


async def completed(server: Server) -> Sequence[object]:
    return [await post(server[0], chat(8)) for _ in range(5)]


async def refused(server: Server) -> Sequence[object]:
    return [await post(server[0], chat(512), timeout_ms=1) for _ in range(5)]


async def hog_the_only_seat(server: Server) -> asyncio.Task[int]:
    """A request on the only seat, the engine's steps held: it runs until `let_the_hog_end`,
    however long the others wait."""
    port, runtime, engine = server
    engine.gate.hold()
    hog = asyncio.create_task(post(port, chat(300), timeout_ms=10_000))
    await until(lambda: runtime.core.running_count() == 1, "the hog did not start")
    return hog


async def let_the_hog_end(server: Server, hog: asyncio.Task[int]) -> None:
    server[2].gate.open(paced=False)
    await hog


async def expired_queued(server: Server) -> Sequence[object]:
    hog = await hog_the_only_seat(server)
    statuses = await asyncio.gather(*(post(server[0], chat(8), timeout_ms=200) for _ in range(5)))
    await let_the_hog_end(server, hog)
    return statuses


async def left_queued(server: Server) -> Sequence[object]:
    port, runtime, _ = server
    hog = await hog_the_only_seat(server)
    leave = asyncio.Event()
    waiting = [asyncio.create_task(post(port, chat(8), leave=leave)) for _ in range(5)]
    await until(
        lambda: sum(runtime.core.queue_depth(tc) for tc in TrafficClass) == 5,
        "five requests queued",
    )
    leave.set()
    statuses = await asyncio.gather(*waiting)
    await let_the_hog_end(server, hog)
    return statuses


async def expired_running(server: Server) -> Sequence[object]:
    return await asyncio.gather(*(post(server[0], chat(1500), timeout_ms=300) for _ in range(5)))


async def expired_running_streamed(server: Server) -> Sequence[object]:
    # Streams have started (200) before the deadline; they end with an error event.
    return await asyncio.gather(
        *(post(server[0], chat(1500, stream=True), timeout_ms=300) for _ in range(5))
    )


async def ws_refused(server: Server) -> Sequence[object]:
    return await ws_generate(server[0], 5, max_tokens=512, timeout_ms=1)


async def ws_expired_running(server: Server) -> Sequence[object]:
    return await ws_generate(server[0], 5, max_tokens=1500, timeout_ms=300)


CASES: dict[str, tuple[Callable[[Server], Awaitable[Sequence[object]]], object, BudgetConfig]] = {
    "completed": (completed, 200, BudgetConfig()),
    "refused": (refused, 503, BudgetConfig()),
    "expired_queued": (expired_queued, 504, BudgetConfig(max_running_seqs=1)),
    "left_queued": (left_queued, 0, BudgetConfig(max_running_seqs=1)),
    "expired_running": (expired_running, 504, BudgetConfig()),
    "expired_running_streamed": (expired_running_streamed, 200, BudgetConfig()),
    "ws_refused": (ws_refused, "deadline_unmeetable", BudgetConfig()),
    "ws_expired_running": (ws_expired_running, "deadline_exceeded", BudgetConfig()),
}


@pytest.mark.parametrize("case", CASES)
async def test_an_ended_request_leaves_no_reference_cycle(case: str) -> None:
    run, expected, budgets = CASES[case]
    config = SluiceConfig(estimates=FAST_PRIOR, budgets=budgets)
    with collector_off() as garbage:
        async with sim_server(config) as server:
            outcomes = await run(server)
    assert list(outcomes) == [expected] * 5
    held = {name: count for name, count in garbage.items() if name in PER_REQUEST_TYPES}
    assert held == {}, f"requests held by reference cycles: {held}"
