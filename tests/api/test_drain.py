"""SIGTERM drains: /ready and new requests get 503 at once, running streams finish (or, past
`--drain-seconds`, end with a `shutting_down` error event and `[DONE]`), and Sluice exits 0.
SIGINT (Ctrl-C) drains the same way, and exits 0 without a traceback.

A real Sluice process per case (the sim engine at ~20 ms a step), real streams over loopback.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import SluiceProcess, uncalibrated_config, wait_until

pytestmark = pytest.mark.system


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    started: list[SluiceProcess] = []
    config = uncalibrated_config(tmp_path)  # the drain does not depend on the engine's speed

    def start(*args: str) -> SluiceProcess:
        process = SluiceProcess(
            ["--engine", "sim", "--sim-step-base-ms", "20", "--config", str(config), *args],
            tmp_path / f"server-{len(started)}.log",
        )
        started.append(process)
        process.wait_ready(60)
        return process

    yield start
    for process in started:
        process.stop()


async def _stream(
    client: httpx.AsyncClient, max_tokens: int, streaming: asyncio.Event
) -> list[str]:
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    data = []
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Request-Timeout-Ms": "600000"}
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
                streaming.set()
    return data


async def _drain_with_streams(
    server: SluiceProcess, count: int, max_tokens: int, sig: signal.Signals = signal.SIGTERM
) -> list[list[str]]:
    """Start `count` streams, send `sig` once all stream, check the refusals, collect them."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        started = [asyncio.Event() for _ in range(count)]
        streams = [asyncio.create_task(_stream(client, max_tokens, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
        server.proc.send_signal(sig)
        # Draining: not ready, and a new request is refused, with Retry-After.
        ready = await client.get("/ready")
        assert ready.status_code == 503
        refused = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 4},
        )
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        assert "retry-after" in refused.headers
        return await asyncio.gather(*streams)


async def test_sigterm_lets_running_streams_finish_then_exits_0(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server()
    results = await _drain_with_streams(server, 20, 120)
    for data in results:
        assert data[-1] == "[DONE]"
        finish = json.loads(data[-2])
        assert finish["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0


async def test_streams_past_the_drain_end_with_shutting_down(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server("--drain-seconds", "1")
    results = await _drain_with_streams(server, 4, 2000)
    for data in results:
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=30) == 0
    wait_until(lambda: "drained" in server.log(), 60)


async def test_sigint_drains_as_sigterm_does_and_exits_0_without_a_traceback(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server()
    results = await _drain_with_streams(server, 4, 120, signal.SIGINT)
    for data in results:
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=30) == 0
    log = server.log()
    assert "SIGINT: draining" in log and "drained" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log


async def test_a_signal_during_the_drain_stops_at_once_and_still_exits_0(start_server) -> None:  # type: ignore[no-untyped-def]
    server = start_server("--drain-seconds", "600")
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        streaming = asyncio.Event()
        stream = asyncio.create_task(_stream(client, 5000, streaming))
        await asyncio.wait_for(streaming.wait(), 30)
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: draining" in server.log(), 60)
        server.proc.send_signal(signal.SIGINT)  # stop now: the open stream is ended
        assert await asyncio.to_thread(server.proc.wait, 30) == 0
        await asyncio.gather(stream, return_exceptions=True)  # (how it ends is uvicorn's)
    log = server.log()
    assert "SIGINT again: stopping now" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
