"""Cancellation reaches the real vLLM engine: SSE clients that leave stop costing engine time.
A WebSocket's cancel message and close: tests/websocket_api/test_websocket_api.py."""

from __future__ import annotations

import asyncio

import httpx
from conftest import SluiceProcess, wait_until

MODEL = "sluice-demo"
# Long answers (cut short by the tests) need a deadline their full length could meet, or the
# scheduler rightly refuses them as deadline_unmeetable.
LONG_DEADLINE_MS = 600_000


def _chat(i: int, max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"client {i} asks"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def _engine_idle(server: SluiceProcess) -> bool:
    return server.metric("sluice_engine_unfinished_requests") == 0


async def test_fifty_sse_clients_disconnect_mid_generation(vllm_server: SluiceProcess) -> None:
    wait_until(lambda: _engine_idle(vllm_server), 30, message="engine idle before the test")
    aborts_before = vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")

    async def leave_after_tokens(client: httpx.AsyncClient, i: int) -> int:
        received = 0
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json=_chat(i, 1500),
            headers={"X-Request-Timeout-Ms": str(LONG_DEADLINE_MS)},
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                    received += 1
                    if received == 5:
                        break  # leaving the block closes the connection mid-stream
        return received

    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as client:
        received = await asyncio.gather(*(leave_after_tokens(client, i) for i in range(50)))
    assert received == [5] * 50

    # Every engine request is aborted: nothing is left running or waiting inside vLLM.
    wait_until(lambda: _engine_idle(vllm_server), 30, message="engine requests aborted")
    aborted = vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")
    assert aborted - aborts_before == 50
    assert vllm_server.metric("sluice_running_requests") == 0

    # The generated-token counter has stopped growing: one more complete request of 7 tokens
    # moves it by exactly 7, so no aborted request produced tokens while it ran.
    tokens_before = vllm_server.metric("sluice_generated_tokens_total")
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        body = {**_chat(99, 7), "stream": False}
        reply = (await client.post("/v1/chat/completions", json=body)).json()
    assert reply["usage"]["completion_tokens"] == 7
    assert vllm_server.metric("sluice_generated_tokens_total") - tokens_before == 7
