"""vLLM's `/tokenize`, `/detokenize` and `/version`, and token ids checked against the real
vocabulary: the real engine's tokenizer where it matters, the sim engine for the errors."""

from __future__ import annotations

import httpx
import pytest
from conftest import InProcessSluice, SluiceProcess

MODEL = "sluice-demo"


def _post(server: SluiceProcess | InProcessSluice, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_with_the_models_tokenizer(vllm_server: SluiceProcess) -> None:
    text = "Tell me about schedulers."
    for special in (True, False):  # the demo tokenizer adds no BOS; a Llama's would
        counted = _post(
            vllm_server,
            "/tokenize",
            {"model": MODEL, "prompt": text, "add_special_tokens": special},
        ).json()
        assert counted["count"] == len(counted["tokens"]) > 3
        assert counted["max_model_len"] > 0 and counted["token_strs"] is None
        strings = _post(
            vllm_server,
            "/tokenize",
            {"prompt": text, "return_token_strs": True, "add_special_tokens": special},
        ).json()
        assert strings["tokens"] == counted["tokens"]
        # Byte-level BPE spells a leading space 'Ġ'; the strings join back to the text.
        assert "".join(strings["token_strs"]).replace("Ġ", " ") == text
        back = _post(vllm_server, "/detokenize", {"model": MODEL, "tokens": counted["tokens"]})
        assert back.json() == {"prompt": text}
        usage = httpx.post(
            vllm_server.url + "/v1/completions",
            timeout=60,
            json={
                "model": MODEL,
                "prompt": text,
                "max_tokens": 1,
                "add_special_tokens": special,
            },
        ).json()["usage"]
        assert usage["prompt_tokens"] == counted["count"]  # what a generation is charged

    chat = [{"role": "user", "content": text}]
    rendered = _post(vllm_server, "/tokenize", {"model": MODEL, "messages": chat}).json()
    usage = httpx.post(
        vllm_server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": chat, "max_tokens": 1},
    ).json()["usage"]
    assert rendered["count"] == usage["prompt_tokens"] > counted["count"]  # the template's
    # Without the generation prompt (the demo template's `<|assistant|>`), one token fewer;
    # a chat that continues its last message renders alike (no end of message, no prompt).
    bare = _post(
        vllm_server, "/tokenize", {"model": MODEL, "messages": chat, "add_generation_prompt": False}
    ).json()
    assert bare["tokens"] == rendered["tokens"][:-1]
    continued = httpx.post(
        vllm_server.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [*chat, {"role": "assistant", "content": "It is"}],
            "max_tokens": 1,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert continued.status_code == 200, continued.text


def test_a_token_id_outside_the_vocabulary_is_a_400_not_a_retried_500(
    vllm_server: SluiceProcess,
) -> None:
    import openai  # here, not at the top: every pytest-xdist worker collects this module

    vocab = httpx.get(vllm_server.url + "/v1/models").json()["data"][0]  # the model exists
    assert vocab["id"] == MODEL
    client = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=2)
    chat = [{"role": "user", "content": "hi"}]
    for extra, param in (
        ({"logit_bias": {"10000000": 5}}, "logit_bias"),
        ({"stop_token_ids": [10_000_000]}, "stop_token_ids"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=chat, max_tokens=2, extra_body=extra
            )
        assert caught.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[1, 10_000_000], max_tokens=2)
    assert vllm_server.metric("sluice_budget_in_use") == 0


def test_version(sim_server: InProcessSluice) -> None:
    version = httpx.get(sim_server.url + "/version").json()["version"]
    assert version and version[0].isdigit()


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, 400, "return_token_strs"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),  # (it needs add_generation_prompt: false)
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/detokenize", {"tokens": [1, 2048]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_tokenizer_route_errors(
    sim_server: InProcessSluice, path: str, body: dict, status: int, param: str
) -> None:
    response = _post(sim_server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_sim_round_trip(sim_server: InProcessSluice) -> None:
    tokens = _post(sim_server, "/tokenize", {"prompt": "the old horse"}).json()["tokens"]
    assert len(tokens) == 3
    assert _post(sim_server, "/detokenize", {"tokens": tokens}).json() == {
        "prompt": " the old horse"
    }
    strings = _post(
        sim_server, "/tokenize", {"prompt": "the old horse", "return_token_strs": True}
    ).json()["token_strs"]
    assert strings == [" the", " old", " horse"]


def test_a_chat_is_tokenized_with_the_chat_templates_arguments(sim_server: InProcessSluice) -> None:
    """vLLM's chat /tokenize fields: the template's arguments as a chat takes them; what
    changes nothing ignored (the router sends `continue_final_message: false`)."""
    chat = [{"role": "user", "content": "the old horse"}, {"role": "assistant", "content": "it"}]
    plain = _post(sim_server, "/tokenize", {"messages": chat}).json()["tokens"]
    ignored = _post(
        sim_server,
        "/tokenize",
        {
            "messages": chat,
            "continue_final_message": False,
            "add_special_tokens": False,
            "chat_template_kwargs": {"enable_thinking": False},
            "mm_processor_kwargs": {},
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "sparkle": 1,
        },
    )
    assert ignored.status_code == 200, ignored.text
    assert ignored.json()["tokens"] == plain  # (the sim's template shows no tools)
    continued = _post(
        sim_server,
        "/tokenize",
        {"messages": chat, "continue_final_message": True, "add_generation_prompt": False},
    ).json()["tokens"]
    assert continued == plain[:-2]  # no end of the last message, no generation prompt
