"""vLLM's render endpoints (`/v1/chat/completions/render`, `/v1/completions/render`,
`/v1/responses/render`): answered in the shape of vLLM's `GenerateRequest`, with the token ids
`/tokenize` gives and a generation runs on. The sim engine for the shapes and errors; the real
engine, once, for its tokenizer's ids."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import ROUTER_CHAT, ROUTER_COMPLETION, InProcessSluice, SluiceProcess

# vLLM's GenerateRequest, as vLLM 0.32's server answers a render.
GENERATE_REQUEST = {
    "request_id",
    "token_ids",
    "token_offsets",
    "features",
    "content_parts",
    "sampling_params",
    "model",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
    "output_mode",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "ec_transfer_params",
}
# Its sampling_params for the router's chat body, as vLLM 0.32's server answered it.
ROUTER_CHATS_SAMPLING = {
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "output_kind",
    "skip_clone",
    "bad_words",
    "skip_reading_prefix_cache",
}
MESSAGES = ROUTER_CHAT["messages"]


def _post(
    server: InProcessSluice | SluiceProcess, path: str, body: Any, **headers: str
) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def _tokens(server: InProcessSluice | SluiceProcess, body: dict[str, Any]) -> list[int]:
    reply = _post(server, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def test_a_chat_renders_as_vllm_answers(sim_server: InProcessSluice) -> None:
    reply = _post(sim_server, "/v1/chat/completions/render", ROUTER_CHAT, **{"X-Request-Id": "r1"})
    assert reply.status_code == 200, reply.text
    rendered = reply.json()
    assert rendered.keys() == GENERATE_REQUEST
    assert rendered["request_id"] == "chatcmpl-r1"
    assert rendered["token_ids"] == _tokens(sim_server, {"messages": MESSAGES})
    assert rendered["sampling_params"].keys() == ROUTER_CHATS_SAMPLING
    assert rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["sampling_params"]["output_kind"] == 2  # vLLM's FINAL_ONLY
    assert rendered["output_mode"] == "tokens" and rendered["priority"] == 0
    assert rendered["stream"] is False and rendered["stream_options"] is None
    # The prompt a generation of the same body is charged for.
    usage = _post(sim_server, "/v1/chat/completions", ROUTER_CHAT).json()["usage"]
    assert usage["prompt_tokens"] == len(rendered["token_ids"])

    streamed = _post(
        sim_server,
        "/v1/chat/completions/render",
        {**ROUTER_CHAT, "stream": True, "stream_options": {"include_usage": True}},
    ).json()
    assert streamed["stream"] is True and streamed["sampling_params"]["output_kind"] == 1
    assert streamed["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    # The sampling parameters a request sets, by vLLM's names; max_tokens as the context
    # leaves it when the request sets none.
    sampled = _post(
        sim_server,
        "/v1/chat/completions/render",
        {"messages": MESSAGES, "temperature": 0.5, "seed": 3, "stop": ["x"], "cache_salt": "s"},
    ).json()
    params = sampled["sampling_params"]
    assert (params["temperature"], params["seed"], params["stop"]) == (0.5, 3, ["x"])
    assert params["max_tokens"] == 2048 - len(sampled["token_ids"])  # the sim's context
    assert sampled["cache_salt"] == "s" and sampled["model"] is None


def test_a_completion_renders_one_request_per_prompt(sim_server: InProcessSluice) -> None:
    one = _post(sim_server, "/v1/completions/render", ROUTER_COMPLETION, **{"X-Request-Id": "r2"})
    assert one.status_code == 200, one.text
    [rendered] = one.json()
    assert rendered.keys() == GENERATE_REQUEST and rendered["request_id"] == "cmpl-r2"
    assert rendered["token_ids"] == _tokens(sim_server, {"prompt": "hello there"})
    several = _post(
        sim_server,
        "/v1/completions/render",
        {"prompt": ["hello", "there"], "max_tokens": 3},
        **{"X-Request-Id": "r3"},
    ).json()
    assert [r["request_id"] for r in several] == ["cmpl-r3-0", "cmpl-r3-1"]
    assert [r["token_ids"] for r in several] == [
        _tokens(sim_server, {"prompt": text}) for text in ("hello", "there")
    ]
    [ids] = _post(sim_server, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()
    assert ids["token_ids"] == [5, 6, 7]


def test_a_response_renders_as_the_chat_it_runs(sim_server: InProcessSluice) -> None:
    body = {"input": "hello there", "instructions": "be brief", "max_output_tokens": 5}
    reply = _post(sim_server, "/v1/responses/render", body)
    assert reply.status_code == 200, reply.text
    rendered = reply.json()
    assert rendered.keys() == GENERATE_REQUEST and rendered["request_id"].startswith("resp_")
    system = [{"role": "system", "content": "be brief"}]
    assert rendered["token_ids"] == _tokens(sim_server, {"messages": [*system, *MESSAGES]})
    assert rendered["sampling_params"]["max_tokens"] == 5 and rendered["stream"] is False
    stateful = _post(sim_server, "/v1/responses/render", {**body, "previous_response_id": "r"})
    assert stateful.status_code == 400
    assert stateful.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions/render", {"model": "gpt-9", "messages": MESSAGES}, 404, "model"),
        ("/v1/chat/completions/render", {}, 400, "messages"),
        (
            "/v1/chat/completions/render",
            {"messages": MESSAGES, "use_beam_search": True},
            400,
            "use_beam_search",
        ),
        (
            "/v1/chat/completions/render",
            {"messages": MESSAGES, "return_hidden_states": True},
            400,
            "return_hidden_states",
        ),
        (
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "word " * 5000}]},
            400,
            "messages",
        ),
        ("/v1/completions/render", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": [5, 99999]}, 400, "prompt"),
        ("/v1/completions/render", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/v1/responses/render", {"input": "x", "model": "gpt-9"}, 404, "model"),
        ("/v1/responses/render", {"input": "x", "max_tool_calls": 1}, 400, "max_tool_calls"),
    ],
)
def test_render_errors(
    sim_server: InProcessSluice, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    reply = _post(sim_server, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param
    assert sim_server.metric("sluice_budget_in_use") == 0  # a render holds nothing


def test_render_gives_the_real_tokenizers_ids(vllm_server: SluiceProcess) -> None:
    """The same ids as /tokenize and as vLLM 0.32's own server answered its render for the
    demo model (`vllm serve ~/.cache/sluice/demo-model --enable-scale-out`): the tokenizer
    and the chat template are the model's."""
    chat = _post(vllm_server, "/v1/chat/completions/render", ROUTER_CHAT).json()
    assert chat["token_ids"] == _tokens(vllm_server, {"messages": MESSAGES})
    assert chat["token_ids"] == [0, 4, 914, 273, 269, 1, 5]
    [completion] = _post(vllm_server, "/v1/completions/render", ROUTER_COMPLETION).json()
    assert completion["token_ids"] == _tokens(vllm_server, {"prompt": "hello there"})
    assert completion["token_ids"] == [914, 273, 269]
    assert chat["sampling_params"].keys() == ROUTER_CHATS_SAMPLING
