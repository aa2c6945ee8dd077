"""LoRA adapters served as models on the real vLLM engine: the base model and two demo adapters
(`--lora-modules`), each selected by a request's `model`. The keyed server's (tests/conftest.py),
as its tenant `lora`, which may use every model it serves.

Greedy text is compared within the run, never against text written here: each demo adapter
gives every token one likeliest successor of its own, as decisive as the base model's, so its
text holds across batch shapes on any CPU, and differs from the base model's and the other
adapter's from the first token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import LORA_ADAPTERS as ADAPTERS
from conftest import VLLM_ENV, SluiceProcess, tenant_key

from engine_adapters.demo_model import GREEDY_MARGIN

BASE = "sluice-demo"
ASK: dict[str, Any] = {"max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about schedulers."}]
KEY = tenant_key("lora")
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def server(keyed_vllm_server: SluiceProcess) -> SluiceProcess:
    return keyed_vllm_server


def test_models_lists_each_adapter_with_its_base(
    server: SluiceProcess, demo_adapters: dict[str, Path], demo_model_dir: Path
) -> None:
    # Those of the start alone: the runtime LoRA tests on this server unload what they load.
    cards = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [card["id"] for card in cards] == [BASE, *ADAPTERS]
    assert (cards[0]["parent"], cards[0]["root"]) == (None, str(demo_model_dir))
    for card in cards[1:]:
        assert (card["parent"], card["root"]) == (BASE, str(demo_adapters[card["id"]]))
    # Each adapter's chats have targets of their own, exported under its name: its own idle
    # step's multiple where the engine was calibrated; here (uncalibrated) the base model's.
    base_itl = server.metric("sluice_slo_target_seconds", model=BASE, target="itl")
    for name in ADAPTERS:
        itl = server.metric("sluice_slo_target_seconds", model=name, target="itl")
        assert itl == base_itl > 0


def test_base_and_adapters_streamed_together_each_give_their_text_alone(
    server: SluiceProcess,
) -> None:
    import openai  # here, not at the top: every pytest-xdist worker collects this module

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    alone = {}
    for model in (BASE, *ADAPTERS):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, **ASK)
        assert reply.model == model
        alone[model] = reply.choices[0].message.content
    assert len(set(alone.values())) == 3  # each model its own text

    async def together() -> dict[str, str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        async def stream(model: str) -> str:
            chunks = await aclient.chat.completions.create(
                model=model,
                messages=MESSAGES,
                stream=True,
                max_tokens=ASK["max_tokens"],
                temperature=ASK["temperature"],
                extra_body=ASK["extra_body"],
            )
            pieces = []
            async for chunk in chunks:
                assert chunk.model == model
                pieces += [choice.delta.content or "" for choice in chunk.choices]
            return "".join(pieces)

        models = [BASE, *ADAPTERS] * 2  # each twice, all at once
        texts = await asyncio.gather(*(stream(model) for model in models))
        await aclient.close()
        assert texts[:3] == texts[3:]
        return dict(zip(models, texts, strict=False))

    assert asyncio.run(together()) == alone


def test_completions_select_the_adapter_too(server: SluiceProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    texts = {
        model: client.completions.create(model=model, prompt="The queue", **ASK).choices[0].text
        for model in (BASE, ADAPTERS[0])
    }
    assert texts[BASE] != texts[ADAPTERS[0]]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "The queue"}),
        ("/v1/responses", {"input": "Hello"}),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": 8}),
    ],
)
def test_an_unknown_model_is_a_404_naming_the_served_ones(
    server: SluiceProcess, path: str, body: dict[str, Any]
) -> None:
    reply = httpx.post(server.url + path, json={"model": "tenant-c", **body}, headers=AUTH)
    assert reply.status_code == 404, reply.text
    message = reply.text
    assert "model_not_found" in message or "not_found_error" in message
    assert all(name in message for name in (BASE, *ADAPTERS))


def test_an_adapter_that_does_not_load_stops_the_start_saying_why(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-adapter-here"
    server = SluiceProcess(
        ["--model", str(demo_model_dir), "--lora-modules", f"broken={missing}"],
        tmp_path / "server.log",
        env=VLLM_ENV,
    )
    try:
        assert server.proc.wait(timeout=300) != 0
        assert f"LoRA adapter 'broken' at '{missing}'" in server.log_path.read_text()
    finally:
        server.stop()


def test_every_api_selects_the_adapter(server: SluiceProcess) -> None:
    """Chat, Responses and Messages render the same prompt from the same message: with the
    adapter named, each gives the adapter's text, and names the adapter as its model."""
    url, model = server.url, ADAPTERS[1]
    text = "Tell me about schedulers."
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0},
        headers=AUTH,
    ).json()
    responses = httpx.post(
        url + "/v1/responses",
        json={"model": model, "input": text, "max_output_tokens": 16, "temperature": 0},
        headers=AUTH,
    ).json()
    messages = httpx.post(
        url + "/v1/messages",
        json={"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0},
        headers=AUTH,
    ).json()
    expected = chat["choices"][0]["message"]["content"]
    assert chat["model"] == responses["model"] == messages["model"] == model
    assert responses["output"][0]["content"][0]["text"] == expected
    assert messages["content"][0]["text"] == expected
    assert _over_the_websocket(url, model, MESSAGES) == expected


def _over_the_websocket(url: str, model: str, messages: list[Any]) -> str:
    """The text of one generation on `/v1/ws`, read to its `final` message."""
    import json

    from websockets.sync.client import connect

    request = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    with connect(url.replace("http", "ws", 1) + "/v1/ws", additional_headers=AUTH) as ws:
        ws.send(json.dumps({"type": "generate", "id": "g", "request": request}))
        pieces = []
        while (message := json.loads(ws.recv(timeout=60)))["type"] == "delta":
            pieces.append(message["text"])
    assert message["type"] == "final", message
    return "".join(pieces)


@pytest.mark.parametrize("model", ADAPTERS)
def test_each_adapter_leads_by_the_margin(server: SluiceProcess, model: str) -> None:
    """The demo adapters are as decisive as the demo model: greedy text never turns on a
    near-tie (the demo model's own check: tests/engine_adapters/test_demo_model.py)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, logprobs=True, top_logprobs=2, **ASK
    )
    steps = reply.choices[0].logprobs.content or []  # type: ignore[union-attr]
    assert len(steps) == ASK["max_tokens"]
    for step in steps:
        first, second = step.top_logprobs[0], step.top_logprobs[1]
        assert step.token == first.token
        assert first.logprob - second.logprob >= GREEDY_MARGIN, (step.token, first, second)
