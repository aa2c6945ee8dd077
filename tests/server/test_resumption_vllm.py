"""The resumption contract on the real vLLM engine (the session's demo-model server): a resumed
stream is the uninterrupted one (greedy), idempotent retries attach or replay, duplicates
reach the engine once, and generate+cancel races end every generation once.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets

from tests.conftest import SluiceProcess, wait_until
from tests.server.test_resumption import generation_id, resume, stream, text_of


def greedy(max_tokens: int = 48) -> dict:
    return {"messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}


def test_a_resumed_stream_is_the_uninterrupted_one(vllm_server: SluiceProcess) -> None:
    _, whole = stream(vllm_server, greedy(), {})
    _, head = stream(vllm_server, greedy(), {"Idempotency-Key": "vllm-story"}, leave_after=6)
    status, tail = resume(vllm_server, generation_id(head), {"Last-Event-ID": str(head[-1][0])})
    assert status == 200 and tail[-1][1] == "[DONE]"
    assert [i for i, _ in tail] == list(range(head[-1][0] + 1, head[-1][0] + 1 + len(tail)))
    assert text_of(head + tail) == text_of(whole)


def test_an_idempotent_retry_attaches_then_replays(vllm_server: SluiceProcess) -> None:
    headers = {"Idempotency-Key": "vllm-retry"}
    _, first = stream(vllm_server, greedy(), headers, leave_after=3)
    replayed, attached = stream(vllm_server, greedy(), headers)
    assert replayed["idempotent-replayed"] == "true" and attached[:3] == first
    assert stream(vllm_server, greedy(), headers)[1] == attached  # after the end
    changed = httpx.post(vllm_server.url + "/v1/chat/completions", json=greedy(8),
                         headers=headers)
    assert changed.status_code == 422


async def test_concurrent_duplicates_reach_the_engine_once(vllm_server: SluiceProcess) -> None:
    wait_until(lambda: vllm_server.metric("sluice_running_requests") == 0, 30)
    before = vllm_server.metric("sluice_requests_total")
    body = {**greedy(16), "stream": False}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        replies = await asyncio.gather(*(client.post(
            "/v1/chat/completions", json=body, headers={"Idempotency-Key": "vllm-whole"})
            for _ in range(6)))
    assert {reply.status_code for reply in replies} == {200}
    assert len({json.dumps(reply.json()["choices"]) for reply in replies}) == 1
    wait_until(lambda: vllm_server.metric("sluice_running_requests") == 0, 30)
    assert vllm_server.metric("sluice_requests_total") - before == 1


async def test_generate_then_cancel_races_end_each_generation_once(
    vllm_server: SluiceProcess,
) -> None:
    url = vllm_server.url.replace("http://", "ws://") + "/v1/ws"
    request = {"messages": [{"role": "user", "content": "race"}], "max_tokens": 8}
    terminal: dict[str, list[str]] = {}
    async with websockets.connect(url, max_size=None) as ws:
        async def send_pairs() -> None:
            for i in range(1000):
                await ws.send(json.dumps({"type": "generate", "id": f"g{i}", "request": request}))
                if i % 3:
                    await ws.send(json.dumps({"type": "cancel", "id": f"g{i}"}))
        sending = asyncio.create_task(send_pairs())
        while sum(len(v) for v in terminal.values()) < 1000:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if message["type"] == "delta":
                if int(message["id"][1:]) % 3 == 0:
                    await ws.send(json.dumps({"type": "cancel", "id": message["id"]}))
                continue
            terminal.setdefault(message["id"], []).append(message["type"])
        await sending
    assert sorted(terminal) == sorted(f"g{i}" for i in range(1000))
    assert all(len(kinds) == 1 for kinds in terminal.values())
    wait_until(lambda: vllm_server.metric("sluice_engine_unfinished_requests") == 0
               and vllm_server.metric("sluice_running_requests") == 0, 60,
               message="every engine request ended")
