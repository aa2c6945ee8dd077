"""Cancellation reaches the real vLLM engine: clients that leave stop costing engine time."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets
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


async def test_websocket_twenty_generations_half_cancelled(vllm_server: SluiceProcess) -> None:
    wait_until(lambda: _engine_idle(vllm_server), 30, message="engine idle before the test")
    ws_url = vllm_server.url.replace("http://", "ws://") + "/v1/ws"
    finals: dict[str, dict] = {}
    tokens: dict[str, int] = {}
    async with websockets.connect(ws_url, max_size=None) as ws:
        for i in range(20):
            long = i % 2 == 0  # even ids are cancelled, so they ask for a long answer
            request = {**_chat(i, 1500 if long else 24)}
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": f"g{i}",
                        "request": request,
                        "timeout_ms": LONG_DEADLINE_MS,
                    }
                )
            )
        cancelled: set[str] = set()
        while len(finals) < 20:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            assert message["type"] in ("delta", "final"), message
            gen_id = message["id"]
            if message["type"] == "delta":
                tokens[gen_id] = tokens.get(gen_id, 0) + message["tokens"]
                if int(gen_id[1:]) % 2 == 0 and gen_id not in cancelled and tokens[gen_id] >= 3:
                    cancelled.add(gen_id)
                    await ws.send(json.dumps({"type": "cancel", "id": gen_id}))
            else:
                assert gen_id not in finals, "one final message per generation"
                finals[gen_id] = message
        for i in range(20):
            final = finals[f"g{i}"]
            if i % 2 == 0:
                assert final["finish_reason"] == "cancelled"
                assert final["usage"]["completion_tokens"] < 1500
            else:
                assert final["finish_reason"] == "length"
                assert final["usage"]["completion_tokens"] == 24 == tokens[f"g{i}"]
                assert final["timings"]["time_to_first_token_s"] > 0
        wait_until(lambda: _engine_idle(vllm_server), 30, message="cancelled requests aborted")


async def test_closing_the_websocket_aborts_its_generations(vllm_server: SluiceProcess) -> None:
    wait_until(lambda: _engine_idle(vllm_server), 30, message="engine idle before the test")
    aborts_before = vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")
    ws_url = vllm_server.url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(ws_url) as ws:
        for i in range(5):
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": f"c{i}",
                        "request": _chat(i, 1500),
                        "timeout_ms": LONG_DEADLINE_MS,
                    }
                )
            )
        message = json.loads(await asyncio.wait_for(ws.recv(), 60))
        assert message["type"] == "delta", message
        # All five are generating (seen by the server, whatever this client has read so far).
        wait_until(
            lambda: vllm_server.metric("sluice_engine_unfinished_requests") == 5,
            30,
            message="five generations in the engine",
        )
    wait_until(lambda: _engine_idle(vllm_server), 30, message="closing aborted the engine work")
    aborted = vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")
    assert aborted - aborts_before == 5  # aborted, not run to their end
