"""The WebSocket API (`GET /v1/ws`, server/websocket_api): generations multiplexed over one
connection, each ending in one final message; a cancel message or the connection's close stops
what it names on the real vLLM engine; a message that cannot be served gets an error naming its
id (null when none could be read) and the connection goes on. Resuming over the WebSocket is in
tests/generations/test_resumption.py, its bearer subprotocol in tests/api/test_security.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets
from conftest import InProcessSluice, SluiceProcess, wait_until

MODEL = "sluice-demo"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
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


async def test_garbage_on_the_websocket_gets_errors_and_the_connection_survives(
    sim_server: InProcessSluice,
) -> None:
    url = sim_server.url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(url) as ws:
        garbage = [
            "not json",
            "[1,2,3]",
            json.dumps({"type": "generate"}),
            json.dumps({"type": "dance", "id": "a"}),
            json.dumps({"type": "cancel", "id": "never-started"}),  # ignored: nothing runs
            json.dumps({"type": "generate", "id": "b", "request": {"messages": 5}}),
            json.dumps({"type": "generate", "id": "c", "request": {**CHAT, "model": "nope"}}),
        ]
        for raw in garbage:
            await ws.send(raw)
        errors = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in garbage[1:]]
        assert [e["type"] for e in errors] == ["error"] * (len(garbage) - 1)
        assert [e["id"] for e in errors] == [None, None, None, "a", "b", "c"]
        assert errors[-1]["error"]["code"] == "model_not_found"
        # Still usable afterwards.
        await ws.send(json.dumps({"type": "generate", "id": "ok", "request": CHAT}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["type"] == "final":
                break
        assert message["id"] == "ok" and message["usage"]["completion_tokens"] == 4


async def test_a_binary_frame_of_json_is_a_message_and_one_not_utf8_closes_the_connection(
    sim_server: InProcessSluice,
) -> None:
    url = sim_server.url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(url) as ws:
        request = {"type": "generate", "id": "bin", "request": CHAT}
        await ws.send(json.dumps(request).encode())  # bytes: a binary frame
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["type"] == "final":
                break
        assert message["id"] == "bin" and message["usage"]["completion_tokens"] == 4
        await ws.send(b"\xff\xfe")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007


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
