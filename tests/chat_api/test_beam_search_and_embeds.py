"""vLLM's beam search and prompt embeddings through Sluice, with the official `openai` client,
on the real vLLM engine (the demo model; the server runs with `enable_prompt_embeds=true`)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from conftest import InProcessSluice, SluiceProcess, wait_at_zero

# `openai` (~0.5 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

MODEL = "sluice-demo"
PROMPT = "Hello, my name is"


@pytest.fixture
def client(vllm_server: SluiceProcess) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0)


def _error(raised: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, Any]:
    body = raised.value.body
    assert isinstance(body, dict)
    return body


def test_beam_search_as_vllms_server(client: openai.OpenAI, vllm_server: SluiceProcess) -> None:
    # One beam is greedy decoding: the same tokens as temperature 0. (Not quite the same text:
    # the search decodes its tokens at the end, a character cut short and all, as vLLM's does.)
    # Any hardware: the demo model's greedy margin (tests/engine_adapters/test_demo_model.py).
    import openai

    ask: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    greedy = client.completions.create(
        **ask, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    one_beam = client.completions.create(
        **ask, extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True}
    )
    assert (
        one_beam.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]
    )

    # Several prompts, two beams each: the two best, per prompt, numbered across prompts.
    beams = client.completions.create(
        model=MODEL,
        prompt=[PROMPT, PROMPT],
        n=2,
        max_tokens=5,
        temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    texts = [c.text for c in beams.choices]
    assert [c.index for c in beams.choices] == [0, 1, 2, 3]
    # The same prompt twice in one batch: the same rows of the same kernels, on any hardware.
    assert texts[0] != texts[1] and texts[:2] == texts[2:]
    assert beams.usage is not None and beams.usage.completion_tokens == 4 * 5

    # A chat streams its beams (each whole, when the search ends).
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            n=2,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"use_beam_search": True},
        )
    )
    finished = sorted(
        (c.index, c.finish_reason) for chunk in chunks for c in chunk.choices if c.finish_reason
    )
    assert [index for index, _ in finished] == [0, 1]

    # What vLLM's beam search would drop is refused, and a completion does not stream it.
    for extra, param in (
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"stream": True}, "stream"),
    ):
        stream = extra.pop("stream", False)
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                n=2,
                max_tokens=4,
                stream=stream,
                extra_body={"use_beam_search": True, **extra},
            )
        assert _error(raised)["param"] == param
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            response_format={"type": "json_object"},
            extra_body={"use_beam_search": True},
        )
    assert _error(raised)["param"] == "use_beam_search"
    wait_at_zero(
        vllm_server,
        "sluice_budget_in_use",
        "sluice_engine_unfinished_requests",
        timeout=10,
        message="every beam's engine request ended",
    )


def test_a_client_leaving_ends_the_beam_search(vllm_server: SluiceProcess) -> None:
    aborts_before = vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "n": 3,
        "max_tokens": 500,
        "ignore_eos": True,
        "use_beam_search": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", vllm_server.url + "/v1/chat/completions", json=body, timeout=30
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if '"role":"assistant"' in line:
                break  # dispatched: leaving closes the connection mid-search
    wait_at_zero(
        vllm_server,
        "sluice_engine_unfinished_requests",
        "sluice_running_requests",
        timeout=10,
        message="the search's engine requests aborted",
    )
    assert (
        vllm_server.metric("sluice_engine_aborts_total", reason="client_cancelled")
        == aborts_before + 1
    )


def _embeds(demo_model_dir: Path, token_ids: list[int]) -> str:
    """The model's own input embeddings for these tokens, as vLLM's clients send them."""
    from safetensors.torch import load_file

    weights = load_file(demo_model_dir / "model.safetensors")["model.embed_tokens.weight"]
    return _embeds_of(weights[token_ids].clone())


def test_prompt_embeds_generate_as_their_tokens(
    client: openai.OpenAI, vllm_server: SluiceProcess, demo_model_dir: Path
) -> None:
    import openai
    from torch import zeros

    token_ids = httpx.post(
        vllm_server.url + "/tokenize", json={"prompt": PROMPT}, timeout=10
    ).json()["tokens"]
    embeds = _embeds(demo_model_dir, token_ids)
    by_tokens = client.completions.create(
        model=MODEL, prompt=token_ids, max_tokens=8, temperature=0
    )
    by_embeds = client.completions.create(
        model=MODEL, prompt=None, max_tokens=8, temperature=0, extra_body={"prompt_embeds": embeds}
    )
    # Embeddings and token ids reach the same hidden states up to float error. Any hardware:
    # the demo model's greedy margin (tests/engine_adapters/test_demo_model.py).
    assert by_embeds.choices[0].text == by_tokens.choices[0].text
    assert by_embeds.usage is not None and by_embeds.usage.prompt_tokens == len(token_ids)

    # With a prompt too: two prompts, the embeddings' first (as vLLM orders them), streamed.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The queue",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"prompt_embeds": embeds},
        )
    )
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed[0] == by_tokens.choices[0].text and streamed[1]

    for extra, param, message in (
        ({"prompt_embeds": []}, "prompt", "Either prompt or prompt_embeds must be provided"),
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "base64"),
        ({"prompt_embeds": _embeds_of(zeros(3, 7))}, "prompt_embeds", "hidden_size"),
        ({"prompt_embeds": _embeds_of(zeros(2, 3, 256))}, "prompt_embeds", "shape"),
        ({"prompt_embeds": embeds, "echo": True}, "echo", "Echo"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=MODEL, prompt=None, max_tokens=4, extra_body=extra)
        assert _error(raised)["param"] == param and message in _error(raised)["message"]


def _embeds_of(tensor: Any) -> str:
    """A tensor as vLLM's clients send it: `torch.save`d, in base64. (torch is imported
    where the real engine runs only: the sim tests do without it.)"""
    import torch

    saved = io.BytesIO()
    torch.save(tensor, saved)
    return base64.b64encode(saved.getvalue()).decode()


def test_the_sim_engine_refuses_both_naming_itself(sim_server: InProcessSluice) -> None:
    for extra, param in (
        ({"use_beam_search": True, "n": 2}, "use_beam_search"),
        ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ):
        reply = httpx.post(
            sim_server.url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 2, **extra},
            timeout=10,
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "unsupported_parameter" and error["param"] == param
        assert "sim engine" in error["message"]
