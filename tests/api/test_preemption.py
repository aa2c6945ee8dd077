"""Preemption on the real engine: a chat stops a bulk request, whose stream carries on unbroken.

The session's spare replica (vLLM on CPU, demo model, `spare_replica`), with room for two
sequences and no interactive reserve (`TWO_SEATS`), so two bulk streams fill it and a chat can
only start by preempting one of them. The fleet tests use the same replica, before or after:
what this test reads of its metrics and access log is what this test added.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets
from conftest import SharedServer, SluiceProcess

BULK_TOKENS = 1000


@pytest.fixture(scope="module")
def preempting_server(spare_replica: SharedServer) -> SluiceProcess:
    return spare_replica.get()


async def generate_all(
    server: SluiceProcess,
    generations: dict[str, dict[str, Any]],
    logprobs: dict[str, list[str]] | None = None,
    then: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, str], dict[str, dict[str, Any]], list[str]]:
    """Send every generation at once on one WebSocket, and those of `then` once every one of
    the first has streamed a token; read to the end. Returns each generation's text and final
    message, and the order the finals came in; `logprobs` collects the tokens of the logprobs
    entries of those that asked for them."""
    ws_url = server.url.replace("http://", "ws://") + "/v1/ws"
    pending = dict(then or {})
    texts = dict.fromkeys([*generations, *pending], "")
    finals: dict[str, dict[str, Any]] = {}
    streaming: set[str] = set()
    async with websockets.connect(ws_url, max_size=None) as ws:
        for gen_id, fields in generations.items():
            await ws.send(json.dumps({"type": "generate", "id": gen_id, **fields}))
        while len(finals) < len(texts):
            if pending and streaming >= set(generations):
                for gen_id, fields in pending.items():
                    await ws.send(json.dumps({"type": "generate", "id": gen_id, **fields}))
                pending = {}
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            assert message["type"] in ("delta", "final"), message
            if message["type"] == "delta":
                streaming.add(message["id"])
                texts[message["id"]] += message["text"]
                if logprobs is not None and "logprobs" in message:
                    logprobs.setdefault(message["id"], []).extend(
                        entry["token"] for entry in message["logprobs"]
                    )
            else:
                finals[message["id"]] = message
    return texts, finals, list(finals)


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


BULK = {  # with logprobs, which must survive the pause of whichever one is paused
    "b1": {
        "request": {**chat("The first bulk job reads", BULK_TOKENS), "logprobs": True},
        "traffic_class": "bulk",
        "timeout_ms": 600_000,
    },
    "b2": {
        "request": {**chat("A second bulk job writes", BULK_TOKENS), "logprobs": True},
        "traffic_class": "bulk",
        "timeout_ms": 600_000,
    },
}


async def test_a_chat_preempts_bulk_and_the_bulk_stream_continues_unbroken(
    preempting_server: SluiceProcess,
) -> None:
    server = preempting_server
    log_start = server.log_path.stat().st_size  # this test's access log lines follow
    preempted_before = server.metric("sluice_engine_aborts_total", reason="preempted")
    resumed_before = server.metric("sluice_resumed_prefill_tokens_total")

    def preempted() -> float:
        return server.metric("sluice_engine_aborts_total", reason="preempted") - preempted_before

    # b1 and b2 take both seats; the chat, sent once both stream, waits 100 ms and then stops
    # one of them. (Sent all at once, the chat could be queued before either bulk request
    # started, and simply go first.)
    logprobs: dict[str, list[str]] = {}
    texts, finals, order = await generate_all(
        server, BULK, logprobs, then={"chat": {"request": chat("hi", 8)}}
    )
    assert order[0] == "chat"  # it did not wait for a bulk request to end
    assert finals["chat"]["usage"]["completion_tokens"] == 8
    assert preempted() == 1
    for gen_id in BULK:
        assert finals[gen_id]["finish_reason"] == "length"
        assert finals[gen_id]["usage"]["completion_tokens"] == BULK_TOKENS
    # Greedy decoding resumed from prompt + generated tokens gives the same answer as an
    # uninterrupted run: the continuation lost and repeated nothing. Prefill and decode differ
    # in float error only; the greedy choice leads by the demo model's margin
    # (tests/engine_adapters/test_demo_model.py), so it holds on any hardware.
    logprobs_alone: dict[str, list[str]] = {}
    alone, _, _ = await generate_all(server, BULK, logprobs_alone)
    assert [texts[g] for g in BULK] == [alone[g] for g in BULK]
    # One logprobs entry per token, paused or not, and the same tokens either way.
    assert sorted(logprobs) == sorted(logprobs_alone) == ["b1", "b2"]
    for gen_id in BULK:
        assert len(logprobs[gen_id]) == BULK_TOKENS
        assert logprobs[gen_id] == logprobs_alone[gen_id]
    assert preempted() == 1
    assert server.metric("sluice_budget_in_use", budget="sequences") == 0
    assert server.metric("sluice_engine_unfinished_requests") == 0
    # The access log says which request was stopped: one bulk request of the first run, once
    # (the one cheaper to resume); nobody else.
    records = [
        record
        for line in server.log_path.read_bytes()[log_start:].decode().splitlines()
        if line.startswith('{"ts"')
        if (record := json.loads(line))["api"] != "http"  # (metric polls have lines too)
    ]
    stopped = [r["request_id"].rsplit("-", 1)[1] for r in records if r["preemptions"]]
    assert len(stopped) == 1 and stopped[0] in BULK
    assert [r["preemptions"] for r in records if r["preemptions"]] == [1]
    assert sorted(r["request_id"].rsplit("-", 1)[1] for r in records) == [
        "b1",
        "b1",
        "b2",
        "b2",
        "chat",
    ]
    # Its resume was counted through vLLM's num_cached_tokens: what it computed again, here
    # all of its short prompt and output, under one KV block (the sim-engine runtime test
    # checks that a longer one recomputes only what follows its cached blocks).
    block = 128  # vLLM's CPU default
    assert 0 < server.metric("sluice_resumed_prefill_tokens_total") - resumed_before < block
