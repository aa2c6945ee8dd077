"""The resumption contract on the real vLLM engine (the session's demo-model server): a resumed
stream is the uninterrupted one (greedy), idempotent retries attach or replay, duplicates
reach the engine once, and generate+cancel races end every generation once.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from conftest import SluiceProcess, wait_at_zero, wait_until
from test_resumption import (
    generation_id,
    race_generates_and_cancels,
    resume,
    stream,
    text_of,
)


def greedy(max_tokens: int = 48) -> dict:
    return {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def test_a_resumed_stream_is_the_uninterrupted_one(vllm_server: SluiceProcess) -> None:
    _, whole = stream(vllm_server, greedy(), {})
    _, head = stream(vllm_server, greedy(), {"Idempotency-Key": "vllm-story"}, leave_after=6)
    status, tail = resume(vllm_server, generation_id(head), {"Last-Event-ID": str(head[-1][0])})
    assert status == 200 and tail[-1][1] == "[DONE]"
    assert [i for i, _ in tail] == list(range(head[-1][0] + 1, head[-1][0] + 1 + len(tail)))
    # Greedy, on any hardware: the demo model's margin (tests/engine_adapters/test_demo_model.py).
    assert text_of(head + tail) == text_of(whole)


def test_an_idempotent_retry_attaches_then_replays(vllm_server: SluiceProcess) -> None:
    headers = {"Idempotency-Key": "vllm-retry"}
    _, first = stream(vllm_server, greedy(), headers, leave_after=3)
    replayed, attached = stream(vllm_server, greedy(), headers)
    assert replayed["idempotent-replayed"] == "true" and attached[:3] == first
    assert stream(vllm_server, greedy(), headers)[1] == attached  # after the end
    changed = httpx.post(vllm_server.url + "/v1/chat/completions", json=greedy(8), headers=headers)
    assert changed.status_code == 422


async def test_concurrent_duplicates_reach_the_engine_once(vllm_server: SluiceProcess) -> None:
    wait_until(lambda: vllm_server.metric("sluice_running_requests") == 0, 30)
    before = vllm_server.metric("sluice_requests_total")
    body = {**greedy(16), "stream": False}
    async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/v1/chat/completions", json=body, headers={"Idempotency-Key": "vllm-whole"}
                )
                for _ in range(6)
            )
        )
    assert {reply.status_code for reply in replies} == {200}
    assert len({json.dumps(reply.json()["choices"]) for reply in replies}) == 1
    wait_until(lambda: vllm_server.metric("sluice_running_requests") == 0, 30)
    assert vllm_server.metric("sluice_requests_total") - before == 1


async def test_generate_then_cancel_races_end_each_generation_once(
    vllm_server: SluiceProcess,
) -> None:
    await race_generates_and_cancels(
        vllm_server.url.replace("http://", "ws://") + "/v1/ws", max_tokens=8
    )
    wait_at_zero(
        vllm_server,
        "sluice_engine_unfinished_requests",
        "sluice_running_requests",
        timeout=60,
        message="every engine request ended",
    )
