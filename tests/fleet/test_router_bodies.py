"""vLLM's router (`vllm-router`) in front of Sluice: a chat, streamed and whole, and a
completion through it, with the official `openai` client. The router renders each request
first (`/v1/chat/completions/render`, for the prompt's token ids it routes by) and then
forwards it re-serialised with SGLang's defaults (`no_stop_trim`, `separate_reasoning`, ...):
both must be answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import InProcessSluice, RouterProcess, sim_sluice

pytestmark = pytest.mark.system  # a real router process


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with sim_sluice(tmp_path_factory.mktemp("router-worker")) as server:
        yield server


@pytest.fixture(scope="module")
def router(worker: InProcessSluice, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = Path(tmp_path_factory.mktemp("router")) / "router.log"
    with RouterProcess([worker.url], log) as process:
        yield process.url


def test_a_chat_and_a_completion_through_the_router(router: str, worker: InProcessSluice) -> None:
    import openai

    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "tell me a story"}]
    before = worker.metric("sluice_ignored_fields_total", api="chat")
    whole = client.chat.completions.create(model="sim", messages=messages, max_tokens=5)
    assert whole.choices[0].message.content
    streamed = client.chat.completions.create(
        model="sim",
        messages=messages,
        max_tokens=5,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text
    completion = client.completions.create(model="sim", prompt="once upon", max_tokens=5)
    assert completion.choices[0].text
    # What the router added, which changes nothing, was ignored and counted (each chat twice:
    # its render and itself).
    assert worker.metric("sluice_ignored_fields_total", api="chat") > before
    # The router rendered each request here first, and was answered.
    worker.log()  # (flushed)
    log = worker.log_path.read_text()
    for path in ("/v1/chat/completions/render", "/v1/completions/render"):
        assert f'"path":"{path}","outcome":"completed","status":200' in log, log
