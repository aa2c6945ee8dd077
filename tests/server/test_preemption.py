"""Preemption on the real engine: a chat stops a bulk request, whose stream carries on unbroken.

A server of its own (vLLM on CPU, demo model) with room for two sequences and no interactive
reserve, so two bulk streams fill it and a chat can only start by preempting one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import SluiceProcess

MODEL = "sluice-demo"
BULK_TOKENS = 1500  # ~3 s at two sequences: time for the chat to arrive
CONFIG = """
budgets:
  max_running_seqs: 2
  interactive_reserve_share: 0.0
  bulk_min_share: 0.0
  preempt_bulk_after_ms: 100
"""


@pytest.fixture(scope="module")
def preempting_server(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SluiceProcess]:
    where = tmp_path_factory.mktemp("preempt")
    (where / "sluice.yaml").write_text(CONFIG)
    server = SluiceProcess(
        ["--engine", "vllm", "--model", str(demo_model_dir), "--served-model-name", MODEL,
         "--config", str(where / "sluice.yaml")],
        where / "server.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def stream_bulk(
    client: openai.AsyncOpenAI, prompt: str, started: asyncio.Event | None = None
) -> tuple[str, int, list[str]]:
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=BULK_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"X-Traffic-Class": "bulk", "X-Request-Timeout-Ms": "600000"},
    )
    text, tokens, finishes = [], 0, []
    async for chunk in stream:
        if started is not None:
            started.set()
        # Give the loop to the other streams: buffered chunks are read without a suspension,
        # so one fast stream would otherwise hold this client until it ends.
        await asyncio.sleep(0)
        for choice in chunk.choices:
            text.append(choice.text)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens, finishes


async def test_a_chat_preempts_bulk_and_the_bulk_stream_continues_unbroken(
    preempting_server: SluiceProcess,
) -> None:
    server = preempting_server
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    # One-time costs first (the chat template's compilation, the client's lazy imports), so
    # that the chat below reaches the server while both bulk streams still run.
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "warm"}], max_tokens=1)
    prompts = ["The first bulk job reads", "A second bulk job writes"]
    streaming = [asyncio.Event() for _ in prompts]
    bulk = [asyncio.create_task(stream_bulk(client, p, e))
            for p, e in zip(prompts, streaming, strict=True)]
    for event in streaming:  # both hold a seat: their first tokens have arrived
        await asyncio.wait_for(event.wait(), timeout=60)
    reply = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    results = await asyncio.gather(*bulk)
    # The chat got its seat by stopping one bulk request, not by waiting for one to end.
    assert server.metric("sluice_engine_aborts_total", reason="preempted") == 1
    for _, tokens, finishes in results:
        assert tokens == BULK_TOKENS and finishes == ["length"]
    # Greedy decoding resumed from prompt + generated tokens gives the same answer as an
    # uninterrupted run: the continuation lost and repeated nothing.
    again = await asyncio.gather(*(stream_bulk(client, p) for p in prompts))
    assert [text for text, _, _ in results] == [text for text, _, _ in again]
    assert server.metric("sluice_engine_aborts_total", reason="preempted") == 1
    assert server.metric("sluice_budget_in_use", budget="sequences") == 0
    assert server.metric("sluice_engine_unfinished_requests") == 0
