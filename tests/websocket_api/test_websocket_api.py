"""The WebSocket API's protocol (`GET /v1/ws`, server/websocket_api) on the sim engine: a
message that cannot be served gets an error naming its id (null when none could be read) and
the connection goes on; a binary frame of JSON is a message, one not UTF-8 closes the
connection (1007); a final message's usage counts the prompt tokens found in the engine's
prefix cache, a cancelled generation's too. Elsewhere: a cancel message and the connection's
close on the real engine in tests/api/test_cancellation.py, resuming in
tests/generations/test_resumption.py, the bearer subprotocol in tests/api/test_security.py,
tool-call deltas in tests/chat_api/test_structured_outputs.py."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import websockets
from conftest import InProcessSluice

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


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


async def final_of(ws: websockets.ClientConnection, gen_id: str) -> dict:
    """The generation's final message (the connection carries no other generation's)."""
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert message["type"] in ("delta", "final"), message
        if message["type"] == "final":
            assert message["id"] == gen_id
            return message


async def test_a_final_counts_the_prompt_tokens_found_cached_cancelled_or_not(
    sim_server: InProcessSluice,
) -> None:
    """Whole blocks of 128 tokens are cached (the sim's): a prompt sent again finds its blocks;
    a generation cancelled after its first delta reports them too."""
    tag = uuid.uuid4().hex[:8]
    messages = [{"role": "user", "content": " ".join(f"w{tag}x{i}" for i in range(424))}]
    url = sim_server.url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(url) as ws:
        hits = []
        for gen_id in ("first", "again"):
            request = {"messages": messages, "max_tokens": 2}
            await ws.send(json.dumps({"type": "generate", "id": gen_id, "request": request}))
            usage = (await final_of(ws, gen_id))["usage"]
            hits.append(usage["prompt_tokens_details"]["cached_tokens"])
        assert hits[0] == 0 and 3 * 128 <= hits[1] < usage["prompt_tokens"]
        request = {"messages": messages, "max_tokens": 2000}
        await ws.send(json.dumps({"type": "generate", "id": "left", "request": request}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert first["type"] == "delta"
        await ws.send(json.dumps({"type": "cancel", "id": "left"}))
        final = await final_of(ws, "left")
    assert final["finish_reason"] == "cancelled"
    assert final["usage"]["prompt_tokens_details"] == {"cached_tokens": hits[1]}
