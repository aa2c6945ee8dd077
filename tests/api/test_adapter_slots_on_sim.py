"""Adapter slots on the server's own shell (asyncio, the sim engine on the wall clock): a chat
on one LoRA adapter stops the bulk that holds the engine's only slot, and the bulk stream
carries on unbroken once the chat has ended.

A server in this process, the sim engine as fast as it runs (the test holds its steps while
the chat arrives), serving two adapters with one slot (`--max-loras 1`); the same policy under
load, in virtual time, is in
`tests/simulation/test_adapter_slot_flood.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets
from conftest import FAST_SIM, InProcessSluice, sim_sluice, wait_until

BULK_TOKENS = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with sim_sluice(
        tmp_path_factory.mktemp("adapter-slots"),
        *FAST_SIM, "--sim-lora-load-ms", "5",
        "--lora-modules", "bulk-a=adapters/a", "chat-b=adapters/b", "--max-loras", "1",
        config="budgets: {bulk_min_share: 0.0}\n",
    ) as server:  # fmt: skip
        yield server


def request(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "seed": 3,
    }


def test_the_adapters_are_models_of_the_sim_engine(server: InProcessSluice) -> None:
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [
        ("sim", None),
        ("bulk-a", "sim"),
        ("chat-b", "sim"),
    ]
    texts = {
        model: httpx.post(
            server.url + "/v1/chat/completions", json=request(model, 8), timeout=30
        ).json()["choices"][0]["message"]["content"]
        for model in ("sim", "bulk-a", "chat-b")
    }
    assert len(set(texts.values())) == 3  # each adapter draws its own tokens
    # Each model has its own series: requests, tokens, first tokens and gaps.
    for model in ("sim", "bulk-a", "chat-b"):
        assert server.metric("sluice_requests_total", model=model) >= 1
        assert server.metric("sluice_generated_tokens_total", model=model) >= 8
        assert server.metric("sluice_time_to_first_token_seconds_count", model=model) >= 1
        assert server.metric("sluice_inter_token_latency_seconds_count", model=model) >= 1
    # A model not served is counted as `other`, not under the name a client sent.
    unknown = httpx.post(server.url + "/v1/chat/completions", json=request("nope", 4), timeout=30)
    assert unknown.status_code == 404
    assert server.metric("sluice_requests_total", model="other") >= 1
    assert 'model="nope"' not in server.metrics_text()


async def test_a_chat_takes_the_only_slot_from_bulk_and_the_bulk_stream_carries_on(
    server: InProcessSluice,
) -> None:
    def preempted() -> float:
        return server.metric("sluice_bulk_preemptions_total", cause="adapter_slot")

    before = preempted()
    finals: dict[str, dict[str, Any]] = {}
    tokens = {"bulk": 0, "chat": 0}
    # The engine held, a step for each bulk delta read: the bulk is 295 tokens short of its
    # end when the chat arrives, and the engine runs on once the chat has stopped it.
    with server.held_steps() as steps:
        async with websockets.connect(server.url.replace("http", "ws", 1) + "/v1/ws") as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": "bulk",
                        "request": request("bulk-a", BULK_TOKENS),
                        "traffic_class": "bulk",
                        "timeout_ms": 600_000,
                    }
                )
            )
            steps.step()
            while len(finals) < 2:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                assert message["type"] in ("delta", "final"), message
                if message["type"] == "final":
                    finals[message["id"]] = message
                    continue
                tokens[message["id"]] += len(message.get("token_ids") or ()) or 1
                if message["id"] == "bulk" and tokens["bulk"] < 5:
                    steps.step()
                elif message["id"] == "bulk" and tokens["bulk"] == 5:  # it runs: now the chat
                    await ws.send(
                        json.dumps(
                            {"type": "generate", "id": "chat", "request": request("chat-b", 8)}
                        )
                    )
                    await asyncio.to_thread(
                        wait_until, lambda: preempted() == before + 1, 60, message="no preemption"
                    )
                    steps.run()
    assert list(finals) == ["chat", "bulk"]  # the chat did not wait for the bulk to end
    assert finals["chat"]["usage"]["completion_tokens"] == 8
    assert finals["bulk"]["finish_reason"] == "length"
    assert finals["bulk"]["usage"]["completion_tokens"] == BULK_TOKENS
    assert preempted() == before + 1
    assert server.metric("sluice_budget_in_use", budget="sequences") == 0
