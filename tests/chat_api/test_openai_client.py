"""The official `openai` client, unchanged, against Sluice serving the real vLLM engine on CPU."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from engine_adapters.demo_model import GREEDY_MARGIN

# `openai` (~0.5 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

MODEL = "sluice-demo"
CHAT = [{"role": "user", "content": "Tell me about schedulers."}]


@pytest.fixture
def client(vllm_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0)


def test_streams_a_chat_completion_with_usage_and_timings(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens > 0
    timings = usage_chunk.model_extra["timings"]
    assert 0 <= timings["queue_wait_s"] <= timings["time_to_first_token_s"] <= timings["duration_s"]
    assert timings["inter_token_latency_median_s"] > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_chat_completion_without_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        extra_body={"ignore_eos": True, "top_k": 20, "min_tokens": 4, "repetition_penalty": 1.1},
    )
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.model_extra["timings"]["duration_s"] > 0


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        reply = client.completions.create(
            model=MODEL,
            prompt="The queue",
            max_tokens=16,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        return reply.choices[0].text

    assert sample() == sample()


def test_text_completion_streaming(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="A batch leaves when",
        max_tokens=10,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].model_extra["timings"]["time_to_first_token_s"] > 0


def test_a_prompt_sent_again_reports_the_blocks_vllm_found_cached(client: openai.OpenAI) -> None:
    """vLLM's prefix cache is on (v1's default), in whole blocks of 128 tokens on CPU: a
    prompt sent again finds its blocks, and `usage.prompt_tokens_details.cached_tokens` says
    how many, whole and in a stream's usage chunk."""
    rng = random.Random()
    # Random, so no earlier request sent it (ids within the demo tokenizer's 1,092).
    prompt = [rng.randrange(10, 1000) for _ in range(2 * 128 + 40)]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == 2 * 128
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 2 * 128


async def test_async_client_streams_concurrently(vllm_server) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=vllm_server.url + "/v1", api_key="unused")

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    assert await asyncio.gather(*(one(i) for i in range(8))) == [16] * 8
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens <= 3
    await client.close()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_continuous_usage_counts_tokens_in_every_chunk(client: openai.OpenAI, kind: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        stream: Any = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=20,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    else:
        stream = client.completions.create(
            model=MODEL,
            prompt="Tell me about schedulers.",
            max_tokens=20,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 20  # so far, never backwards
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    with_text = [
        c
        for c in chunks
        if c.choices and (c.choices[0].delta.content if kind == "chat" else c.choices[0].text)
    ]
    assert with_text and all(c.usage.completion_tokens >= 1 for c in with_text)
    assert chunks[-1].choices == []  # the usage chunk still comes last


def test_chat_logprobs_are_consistent_streamed_or_not(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    reply = client.chat.completions.create(**ask)
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 8  # one per generated token
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        # Greedy: the sampled token is the likeliest one. Any hardware: the demo model's
        # likeliest token leads by GREEDY_MARGIN nats (tests/engine_adapters/test_demo_model.py),
        # so no kernel breaks a tie differently; the logprobs themselves agree to a tolerance.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(tops[0], abs=1e-3)
        assert tops[0] - tops[1] >= GREEDY_MARGIN
        assert entry.bytes == list(entry.token.encode())
    streamed = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    entries = [
        e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in entries] == [e.token for e in content]  # greedy, by the margin


def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="Tell me about schedulers.",
        max_tokens=8,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.tokens) == 8
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs or [], strict=True):
        assert token in top and 1 <= len(top) <= 3  # the sampled token and the 2 best


def test_n_streams_three_indexed_choices(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = dict(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    texts = ["", "", ""]
    finished = []
    roles = []
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason:
                finished.append((choice.index, choice.finish_reason))
    assert sorted(roles) == [0, 1, 2]  # each choice opens with its role
    assert sorted(finished) == [(0, "length"), (1, "length"), (2, "length")]
    assert all(texts) and len(set(texts)) > 1  # three samples, not one sent three times
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3 * 6
    whole = client.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    # Seeded: the same samples. Any hardware: one seed draws the same uniform numbers, and a
    # draw lands on another token only within float error of a boundary of the distribution.
    assert [c.message.content for c in whole.choices] == texts
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    completions = client.completions.create(
        model=MODEL, prompt="The queue", max_tokens=4, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in completions.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in completions.choices)


def test_prompt_logprobs_as_vllm_gives_them(client: openai.OpenAI, vllm_server: Any) -> None:
    prompt = "Tell me about schedulers."
    ids = httpx.post(vllm_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    positions = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    for token_id, candidates in zip(ids[1:], positions[1:], strict=True):
        assert str(token_id) in candidates and 1 <= len(candidates) <= 2  # it, and the best
        assert all(c["logprob"] <= 0 and c["rank"] >= 1 for c in candidates.values())
    named = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    content = named.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [e.token for e in content or ()] == [
        f"token_id:{t}" for t in named.choices[0].model_extra["token_ids"]
    ]
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in chat.model_extra["prompt_logprobs"][1:])


def test_echo_scores_a_prompt_as_eval_harnesses_ask(
    client: openai.OpenAI, vllm_server: Any
) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = httpx.post(vllm_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    # lm-eval's loglikelihood request: the prompt alone, echoed, each token scored.
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == prompt
    assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    # Each scored position's candidates start with the prompt's own token, whatever its rank,
    # as vLLM orders them (lm-eval reads the first as the token's own).
    assert logprobs.top_logprobs is not None
    assert [next(iter(top)) for top in logprobs.top_logprobs[1:]] == logprobs.tokens[1:]
    with_answer = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=3,
        echo=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert with_answer.choices[0].text.startswith(prompt)
    assert len(with_answer.choices[0].text) > len(prompt)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_errors_arrive_as_openai_errors(client: openai.OpenAI, vllm_server: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "word " * 5000}], max_tokens=4
        )
    assert too_long.value.code == "context_length_exceeded"
    # A max_tokens beyond the context left is lowered to what is left, as vLLM's server does.
    context = httpx.post(vllm_server.url + "/tokenize", json={"prompt": "x"}).json()
    prompt = [5] * (context["max_model_len"] - 3)
    clamped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10**6, extra_body={"ignore_eos": True}
    )
    assert clamped.usage is not None and clamped.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"best_of": 2})
    assert unsupported.value.code == "unsupported_parameter"


def test_forwarded_prompt_token_ids_are_the_prompt(client: openai.OpenAI) -> None:
    """vLLM's kv_transfer_params.prompt_token_ids (a disaggregated-serving router forwards the
    prefill stage's prompt): used verbatim instead of the request's own messages."""
    import openai

    baseline = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    reused = baseline.model_extra["prompt_token_ids"]
    assert reused
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "unrelated text"}],
            max_tokens=8,
            temperature=0,
            stream=stream,
            extra_body={
                "kv_transfer_params": {"prompt_token_ids": reused},
                "return_token_ids": True,
            },
        )
        first = next(iter(reply)) if stream else reply
        assert first.model_extra["prompt_token_ids"] == reused
    for bad, param in (
        ({"prompt_token_ids": []}, "kv_transfer_params.prompt_token_ids"),
        ({"remote_engine_id": "x"}, "kv_transfer_params.remote_engine_id"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, extra_body={"kv_transfer_params": bad}
            )
        assert raised.value.body["param"] == param  # type: ignore[index]


def test_allowed_token_ids_and_bad_words_as_vllm_applies_them(client: openai.OpenAI) -> None:
    """vLLM's allowed_token_ids (only these may be generated) and bad_words (never these)."""
    import openai

    allowed = [100, 200, 300]
    reply = client.completions.create(
        model=MODEL,
        prompt="The queue",
        max_tokens=12,
        temperature=1.0,
        seed=3,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
    )
    generated = reply.choices[0].model_extra["token_ids"]
    assert len(generated) == 12 and set(generated) <= set(allowed)

    # A word that is one token of the greedy answer, alone or after a space. vLLM bans the
    # word's own tokens, and its form after a space only when that has as many tokens.
    greedy = client.completions.create(
        model=MODEL,
        prompt="The queue",
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    url = str(client.base_url).removesuffix("/v1/")
    word, token_id = next(
        (word, token_id)
        for token_id in greedy.choices[0].model_extra["token_ids"]
        if (
            word := httpx.post(url + "/detokenize", json={"tokens": [token_id]})
            .json()["prompt"]
            .strip()
        )
        and len(alone := _tokens(url, word)) == 1
        and [token_id] in (alone, _tokens(url, " " + word))
    )
    banned = client.completions.create(  # as long: unbanned, it would repeat the greedy one
        model=MODEL,
        prompt="The queue",
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True, "bad_words": [word], "return_token_ids": True},
    )
    assert token_id not in banned.choices[0].model_extra["token_ids"]

    for extra, param in (
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
        assert raised.value.body["param"] == param  # type: ignore[index]


def test_reasoning_effort_as_the_openai_client_sends_it(client: openai.OpenAI) -> None:
    """Given to the chat template (the demo's ignores it), as vLLM's server does."""
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, reasoning_effort="low"
    )
    assert reply.choices[0].finish_reason in ("length", "stop")


def _tokens(url: str, text: str) -> list[int]:
    return httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()[
        "tokens"
    ]
