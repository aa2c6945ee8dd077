"""Prefix-cache hits in `usage.prompt_tokens_details.cached_tokens` on the chat and completions
APIs, read with the official `openai` client: whole and streamed (the usage chunk, and every
chunk with continuous usage), several prompts in one request, vLLM's batched chat, and each
tenant's cache its own.

A real server on loopback, in this process, on the sim engine, whose model keeps a prefix
cache of whole 128-token blocks (as vLLM's does on CPU); each test's prompt is its own, so its
first request finds nothing cached."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from conftest import InProcessSluice, sim_sluice

# `openai` (~0.5 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.xdist_group("cached_tokens")
KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
BLOCK = 128  # the sim's KV block: only whole blocks are cached
MODEL = "sim"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with sim_sluice(tmp_path_factory.mktemp("cached_tokens"), keys=KEYS) as server:
        yield server


def client_of(server: InProcessSluice, key: str = "sk-alpha") -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(server: InProcessSluice) -> openai.OpenAI:
    return client_of(server)


def long_prompt() -> str:
    """Three whole blocks and more (one token a word), that no earlier request sent."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"w{tag}x{i}" for i in range(3 * BLOCK + 40))


def chat(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def cached(usage: Any) -> int:
    """The usage's cached prompt tokens (an `openai` usage object), checked to be a part of
    its prompt."""
    assert usage is not None and usage.prompt_tokens_details is not None
    count = usage.prompt_tokens_details.cached_tokens
    assert count is not None and 0 <= count <= usage.prompt_tokens
    return int(count)


def test_a_chat_prompt_sent_again_is_read_from_the_cache_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    messages = chat(long_prompt())
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert cached(first.usage) == 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []  # the usage chunk
    hit = cached(chunks[-1].usage)
    assert hit >= 3 * BLOCK and hit % BLOCK == 0
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert cached(again.usage) == hit


def test_a_completion_prompt_sent_again_is_read_from_the_cache_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    prompt = long_prompt()
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert cached(list(stream)[-1].usage) == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert cached(again.usage) >= 3 * BLOCK


def test_continuous_usage_carries_the_hit_from_the_engines_first_output_on(
    client: openai.OpenAI,
) -> None:
    """The role chunk is sent before the engine looked the prompt up: it has no cached
    tokens; every chunk after it has the hit, the usage chunk too."""
    messages = chat(long_prompt())
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].usage is not None and chunks[0].usage.prompt_tokens_details is None
    hits = {cached(chunk.usage) for chunk in chunks[1:]}
    assert len(hits) == 1 and hits.pop() >= 3 * BLOCK


def test_several_prompts_in_one_request_add_up_their_hits(client: openai.OpenAI) -> None:
    prompt = long_prompt()
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert cached(alone.usage) == 0
    hit = cached(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage)
    both = client.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=1)
    assert cached(both.usage) == 2 * hit
    stream = client.completions.create(
        model=MODEL,
        prompt=[prompt, prompt],
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert cached(list(stream)[-1].usage) == 2 * hit


def test_vllms_batched_chat_adds_up_its_conversations_hits(server: InProcessSluice) -> None:
    text = long_prompt()
    url, headers = server.url + "/v1/chat/completions", {"Authorization": "Bearer sk-alpha"}
    one = {"model": MODEL, "messages": chat(text), "max_tokens": 1}
    for _ in range(2):
        single = httpx.post(url, json=one, headers=headers, timeout=30).json()
    hit = single["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit >= 3 * BLOCK
    both = {**one, "messages": [chat(text), chat(text)]}
    reply = httpx.post(url + "/batch", json=both, headers=headers, timeout=30).json()
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * hit}


def test_a_tenant_reads_its_own_cached_prompt_and_not_anothers(server: InProcessSluice) -> None:
    """Each tenant's prefix cache is salted with its own name: the same prompt from another
    tenant finds nothing cached."""
    alpha, beta = client_of(server, "sk-alpha"), client_of(server, "sk-beta")
    messages = chat(long_prompt())
    for _ in range(2):
        reply = alpha.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert cached(reply.usage) >= 3 * BLOCK
    other = beta.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert cached(other.usage) == 0
    assert cached(
        beta.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    ) == cached(reply.usage)
