"""Bad input gets a clear OpenAI-shaped error and leaks nothing (sim engine: the real one adds
nothing to validation)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import websockets
from conftest import InProcessSluice, wait_at_zero

from server.openai_wire.requests import parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(server: InProcessSluice, path: str, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(server.url + path, timeout=10, **kwargs)


def _sse_events(server: InProcessSluice, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed response ([DONE] left out)."""
    with httpx.stream("POST", server.url + path, json=body, timeout=10) as response:
        return [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]


def _over_websocket(server: InProcessSluice, request: dict) -> list[dict]:
    """Every message of one generation over the WebSocket, its final one (or error) last."""

    async def generate() -> list[dict]:
        async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "generate", "id": "g", "request": request}))
            messages = []
            while not messages or messages[-1]["type"] not in ("final", "error"):
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            return messages

    return asyncio.run(generate())


def _assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": "hello"}, "invalid_request", "messages"),
        ({"messages": []}, "invalid_request", "messages"),
        ({"messages": [{"role": 7, "content": "x"}]}, "invalid_request", "messages[0].role"),
        ({**CHAT, "max_tokens": "many"}, "invalid_request", "max_tokens"),
        ({**CHAT, "max_tokens": 0}, "invalid_request", "max_tokens"),
        ({**CHAT, "temperature": 9}, "invalid_request", "temperature"),
        ({**CHAT, "stream": "yes"}, "invalid_request", "stream"),
        ({**CHAT, "stop": [1, 2]}, "invalid_request", "stop"),
        ({**CHAT, "n": 0}, "invalid_request", "n"),
        ({**CHAT, "n": 129}, "invalid_request", "n"),
        ({**CHAT, "best_of": 2}, "unsupported_parameter", "best_of"),
        ({**CHAT, "logprobs": 0}, "invalid_request", "logprobs"),  # chat's is a boolean
        ({**CHAT, "top_logprobs": 3}, "invalid_request", "top_logprobs"),  # needs logprobs
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
        ({**CHAT, "echo": 1}, "invalid_request", "echo"),
        (
            {**CHAT, "continue_final_message": True},
            "invalid_request",
            "continue_final_message",
        ),  # it needs add_generation_prompt: false
        ({**CHAT, "prompt_logprobs": -1}, "invalid_request", "prompt_logprobs"),
        ({**CHAT, "stream": True, "prompt_logprobs": 1}, "invalid_request", "prompt_logprobs"),
        ({**CHAT, "add_special_tokens": True}, "unsupported_parameter", "add_special_tokens"),
        (
            {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}},
            "invalid_request",
            "stream_options.include_usage",
        ),
        ({**CHAT, "logit_bias": {"hello": 5}}, "invalid_request", "logit_bias"),
        ({**CHAT, "logit_bias": {"5": "high"}}, "invalid_request", "logit_bias"),
        ({**CHAT, "logit_bias": {"999999": 5}}, "invalid_request", "logit_bias"),
        ({**CHAT, "stop_token_ids": [3, 999999]}, "invalid_request", "stop_token_ids"),
        ({**CHAT, "seed": -(2**63) - 1}, "invalid_request", "seed"),
        ({**CHAT, "tools": [{"type": "function"}]}, "unsupported_parameter", "tools"),  # sim
        ({**CHAT, "tools": 5}, "invalid_request", "tools"),
        ({**CHAT, "tool_choice": ["auto"]}, "invalid_request", "tool_choice"),
        (
            {**CHAT, "response_format": {"type": "json_object"}},
            "unsupported_parameter",
            "response_format",
        ),  # the sim engine generates free text only
        ({**CHAT, "structured_outputs": "json"}, "invalid_request", "structured_outputs"),
        ({**CHAT, "return_hidden_states": True}, "unsupported_parameter", "return_hidden_states"),
        ({**CHAT, "chat_template_kwargs": 3}, "invalid_request", "chat_template_kwargs"),
        (
            {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
            "invalid_request",
            "chat_template_kwargs",
        ),  # the server's own
        ({**CHAT, "reasoning_effort": "extreme"}, "invalid_request", "reasoning_effort"),
        ({**CHAT, "documents": [{"title": 1}]}, "invalid_request", "documents"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
        (
            {"messages": [{"role": "user", "content": "word " * 5000}]},
            "context_length_exceeded",
            "messages",
        ),
    ],
)
def test_chat_body_errors(sim_server: InProcessSluice, body: dict, code: str, param: str) -> None:
    error = _assert_error(_post(sim_server, "/v1/chat/completions", json=body), 400, code)
    assert error["param"] == param


def test_error_messages_name_what_is_wrong(sim_server: InProcessSluice) -> None:
    bias = _post(sim_server, "/v1/chat/completions", json={**CHAT, "logit_bias": {"hello": 5}})
    assert "'hello'" in bias.json()["error"]["message"]
    vocab = _post(sim_server, "/v1/completions", json={"prompt": [5, 2048], "max_tokens": 2})
    assert _assert_error(vocab, 400, "invalid_request")["param"] == "prompt"
    assert "2048" in vocab.json()["error"]["message"]
    # vLLM's words, which its suite matches (test_prompt_validation::test_out_of_vocab_token_ids)
    assert re.search("out of vocabulary", vocab.json()["error"]["message"])
    seed = _post(sim_server, "/v1/chat/completions", json={**CHAT, "seed": -(2**63) - 1})
    assert "greater than or equal to -9223372036854775808" in seed.json()["error"]["message"]
    schema = _post(
        sim_server,
        "/v1/completions",
        json={"prompt": "x", "structured_outputs": {"regex": "[ab]+"}},
    )
    assert _assert_error(schema, 400, "unsupported_parameter")["param"] == "structured_outputs"
    assert "sim engine" in schema.json()["error"]["message"]
    # Tools shown to the template but never called: accepted by an engine that cannot call.
    shown = _post(
        sim_server,
        "/v1/chat/completions",
        json={
            **CHAT,
            "max_tokens": 2,
            "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
    )
    assert shown.status_code == 200, shown.text


def test_any_role_the_template_takes_is_accepted(sim_server: InProcessSluice) -> None:
    body = {"messages": [{"role": "narrator", "content": "once upon a time"}], "max_tokens": 3}
    response = _post(sim_server, "/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_transport_level_errors(sim_server: InProcessSluice) -> None:
    as_json = {"Content-Type": "application/json"}
    _assert_error(
        _post(sim_server, "/v1/chat/completions", content=b"{not json", headers=as_json),
        400,
        "invalid_request",
    )
    _assert_error(
        _post(sim_server, "/v1/chat/completions", content=b"[1, 2]", headers=as_json),
        400,
        "invalid_request",
    )
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = {"Content-Type": content_type} if content_type else {}
        wrong = _post(
            sim_server, "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=headers
        )
        assert "application/json" in _assert_error(wrong, 400, "invalid_request")["message"]
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert (
        _post(
            sim_server, "/v1/chat/completions", content=json.dumps(CHAT).encode(), headers=charset
        ).status_code
        == 200
    )
    _assert_error(
        _post(sim_server, "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}),
        404,
        "model_not_found",
    )
    huge = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    _assert_error(_post(sim_server, "/v1/chat/completions", json=huge), 413, "payload_too_large")
    _assert_error(
        _post(sim_server, "/v1/completions", json={"prompt": [[-1], "b"]}), 400, "invalid_request"
    )
    _assert_error(httpx.get(sim_server.url + "/v1/chat/completions"), 405, "method_not_allowed")
    _assert_error(httpx.get(sim_server.url + "/v2/nothing"), 404, "not_found")


def test_a_request_id_is_echoed(sim_server: InProcessSluice) -> None:
    ok = _post(sim_server, "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
    assert ok.headers["x-request-id"] == "abc-123"
    assert ok.json()["id"] == "chatcmpl-abc-123"
    bad = _post(sim_server, "/v1/chat/completions", json={**CHAT, "n": 5})
    assert len(bad.headers["x-request-id"]) == 32


def test_nothing_leaks_after_bad_input(sim_server: InProcessSluice) -> None:
    for body in (
        {**CHAT, "n": 0},
        {"messages": [{"role": "user", "content": "word " * 5000}]},
        {"messages": 1},
        {**CHAT, "stop_token_ids": [10**6]},
    ):
        _post(sim_server, "/v1/chat/completions", json=body)
    assert sim_server.metric("sluice_running_requests") == 0
    assert sim_server.metric("sluice_queue_depth") == 0
    assert sim_server.metric("sluice_budget_in_use") == 0
    assert sim_server.metric("sluice_engine_unfinished_requests") == 0
    assert sim_server.metric("sluice_requests_total", outcome="invalid") >= 4


def test_sim_engine_logprobs_over_sse_and_websocket(sim_server: InProcessSluice) -> None:
    chat = _post(
        sim_server, "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}
    ).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == 4 and "".join(e["token"] for e in content) == chat["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    text = _post(
        sim_server, "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "logprobs": 0}
    ).json()["choices"][0]
    assert "".join(text["logprobs"]["tokens"]) == text["text"]
    assert [list(top) for top in text["logprobs"]["top_logprobs"]] == [
        [token] for token in text["logprobs"]["tokens"]
    ]  # logprobs 0: the sampled token alone

    deltas = [
        m for m in _over_websocket(sim_server, {**CHAT, "logprobs": True}) if m["type"] == "delta"
    ]
    for refused in ("prompt_logprobs", "echo"):  # nothing a stream cannot carry is ignored
        (error,) = _over_websocket(sim_server, {**CHAT, refused: 1 if refused != "echo" else True})
        assert error["type"] == "error" and error["error"]["param"] == refused
    assert sum(len(m["logprobs"]) for m in deltas) == sum(m["tokens"] for m in deltas) == 4

    # vLLM's prompt_logprobs: each prompt token's (null for the first) and the k likeliest.
    prompt_ids = [5, 6, 7, 8]
    body = _post(
        sim_server,
        "/v1/completions",
        json={"prompt": prompt_ids, "max_tokens": 2, "prompt_logprobs": 2},
    ).json()
    positions = body["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(prompt_ids)
    for token_id, candidates in zip(prompt_ids[1:], positions[1:], strict=True):
        assert str(token_id) in candidates and len(candidates) == 2
        assert sorted(c["rank"] for c in candidates.values()) == [1, 2]
    # vLLM's return_tokens_as_token_ids: tokens named "token_id:N" instead of by their text.
    named = _post(
        sim_server,
        "/v1/completions",
        json={
            "prompt": prompt_ids,
            "max_tokens": 2,
            "prompt_logprobs": 1,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert [c["decoded_token"] for p in named["prompt_logprobs"][1:] for c in p.values()] == [
        f"token_id:{t}" for p in named["prompt_logprobs"][1:] for t in p
    ]
    chat = _post(sim_server, "/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0}).json()
    assert all(p is None or len(p) == 1 for p in chat["prompt_logprobs"])
    plain = _post(sim_server, "/v1/chat/completions", json=CHAT).json()
    assert plain["prompt_logprobs"] is None  # present, as vLLM's server has it


def test_sim_engine_n_choices_over_sse_and_websocket(sim_server: InProcessSluice) -> None:
    events = _sse_events(
        sim_server,
        "/v1/completions",
        {"prompt": "hello", "max_tokens": 3, "n": 2, "seed": 1, "stream": True},
    )
    texts = ["", ""]
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert all(texts) and texts[0] != texts[1]  # seeds 1 and 2
    assert sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"]) == [0, 1]

    *deltas, final = _over_websocket(sim_server, {**CHAT, "n": 3})
    assert {m["index"] for m in deltas} == {0, 1, 2}
    assert final["choices"] == [{"index": i, "finish_reason": "length"} for i in range(3)]
    assert final["usage"]["completion_tokens"] == 3 * CHAT["max_tokens"]


def test_sim_engine_return_token_ids_streamed_and_whole(sim_server: InProcessSluice) -> None:
    prompt = _post(sim_server, "/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    whole = _post(
        sim_server,
        "/v1/completions",
        json={"prompt": "hello there", "max_tokens": 5, "return_token_ids": True},
    ).json()["choices"][0]
    assert whole["prompt_token_ids"] == prompt and len(whole["token_ids"]) == 5
    detokenized = _post(sim_server, "/detokenize", json={"tokens": whole["token_ids"]}).json()
    assert detokenized["prompt"] == whole["text"]
    body = {**CHAT, "seed": 3, "return_token_ids": True}
    chat = _post(sim_server, "/v1/chat/completions", json=body).json()
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 4
    events = _sse_events(sim_server, "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]  # the first chunk only
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]
    assert streamed == chat["choices"][0]["token_ids"]  # seeded: the same tokens
    plain = _post(sim_server, "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert plain.json()["choices"][0]["token_ids"] is None  # present, as vLLM's server has it


def test_every_streamed_completion_chunk_has_the_logprobs_and_token_ids_asked_for(
    sim_server: InProcessSluice,
) -> None:
    """As vLLM's test_return_token_ids::test_comparison_with_prompt_logprobs_and_logprobs
    reads them: each chunk's `logprobs.tokens` and `token_ids`, the finishing chunk's too."""
    import openai  # here, not at the top: every pytest-xdist worker collects this module

    client = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    ids = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(
        model=model,
        prompt="Hello, world!",
        max_tokens=6,
        echo=True,
        logprobs=1,
        extra_body={**ids, "prompt_logprobs": 1},
    ).choices[0]
    assert whole.prompt_logprobs is not None  # type: ignore[attr-defined]
    assert whole.logprobs is not None and whole.logprobs.tokens is not None
    scored = [int(t.removeprefix("token_id:")) for t in whole.logprobs.tokens]
    assert scored == [*whole.prompt_token_ids, *whole.token_ids]  # type: ignore[attr-defined]

    chunks = list(
        client.completions.create(
            model=model, prompt="Hello", max_tokens=6, stream=True, logprobs=1, extra_body=ids
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed: list[int] = []
    in_logprobs: list[int] = []
    for chunk in chunks:
        choice = chunk.choices[0]
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        in_logprobs += [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        streamed += choice.token_ids  # type: ignore[attr-defined]
    assert len(streamed) == 6 and streamed == in_logprobs
    assert chunks[0].choices[0].prompt_token_ids  # type: ignore[attr-defined]


def test_batched_chat_completions_one_choice_per_conversation(sim_server: InProcessSluice) -> None:
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    body = {"messages": conversations, "max_tokens": 4, "seed": 9}
    batch = _post(sim_server, "/v1/chat/completions/batch", json=body)
    assert batch.status_code == 200, batch.text
    reply = batch.json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    singles = [
        _post(sim_server, "/v1/chat/completions", json={**body, "messages": conversation}).json()
        for conversation in conversations
    ]
    # Each conversation is answered as it would be alone (seeded), and usage adds up.
    assert [c["message"]["content"] for c in reply["choices"]] == [
        s["choices"][0]["message"]["content"] for s in singles
    ]
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert len(reply["timings"]) == 3


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": [{"role": "user", "content": "flat"}]}, "invalid_request", "messages"),
        ({"messages": [[]]}, "invalid_request", "messages"),
        (
            {"messages": [[{"role": "user", "content": "x"}]], "stream": True},
            "unsupported_parameter",
            "stream",
        ),
        ({"messages": [[{"role": "user", "content": "x"}]], "n": 2}, "unsupported_parameter", "n"),
        (
            {
                "messages": [
                    [{"role": "user", "content": "x"}],
                    [{"role": "user", "content": "word " * 5000}],
                ]
            },
            "context_length_exceeded",
            "messages",
        ),  # the second refused: the first is let go
    ],
)
def test_a_refused_batch_holds_nothing(
    sim_server: InProcessSluice, body: dict, code: str, param: str
) -> None:
    error = _assert_error(_post(sim_server, "/v1/chat/completions/batch", json=body), 400, code)
    assert error["param"] == param
    assert sim_server.metric("sluice_budget_in_use") == 0
    assert sim_server.metric("sluice_queue_depth") == 0


def test_a_batch_whose_client_leaves_is_cancelled(sim_server: InProcessSluice) -> None:
    body = {
        "messages": [[{"role": "user", "content": "go on"}]] * 2,
        "max_tokens": 1000,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(sim_server.url + "/v1/chat/completions/batch", json=body, timeout=0.3)
    wait_at_zero(
        sim_server,
        "sluice_engine_unfinished_requests",
        "sluice_budget_in_use",
        timeout=10,
        message="the batch's generations were not cancelled",
    )


def test_sim_engine_echo_puts_the_prompt_first(sim_server: InProcessSluice) -> None:
    # Token ids: the sim tokenizer maps unknown words to others, so text would not round-trip.
    ids = _post(sim_server, "/tokenize", json={"prompt": "hello there"}).json()["tokens"]
    prompt = _post(sim_server, "/detokenize", json={"tokens": ids}).json()["prompt"]
    body = {"prompt": ids, "max_tokens": 3, "echo": True, "seed": 4}
    echoed = _post(sim_server, "/v1/completions", json=body).json()["choices"][0]
    plain = _post(sim_server, "/v1/completions", json={**body, "echo": False}).json()
    assert echoed["text"] == prompt + plain["choices"][0]["text"]
    # With logprobs, the prompt's tokens come first; the first has no logprob.
    scored = _post(sim_server, "/v1/completions", json={**body, "logprobs": 1}).json()
    logprobs = scored["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == scored["choices"][0]["text"]
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # max_tokens 0: the prompt alone, scored (how eval harnesses ask for a loglikelihood).
    alone = _post(sim_server, "/v1/completions", json={**body, "max_tokens": 0, "logprobs": 0})
    choice = alone.json()["choices"][0]
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)
    texts = [
        event["choices"][0]["text"]
        for event in _sse_events(sim_server, "/v1/completions", {**body, "stream": True})
        if event["choices"]
    ]
    assert texts[0] == prompt and "".join(texts) == echoed["text"]
    refused = _post(sim_server, "/v1/completions", json={**body, "stream": True, "logprobs": 1})
    assert _assert_error(refused, 400, "invalid_request")["param"] == "echo"
    # Chat: the assistant message the answer continues comes first.
    opening = "the old horse"
    chat = _post(
        sim_server,
        "/v1/chat/completions",
        json={
            **CHAT,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": opening}],
        },
    ).json()
    assert chat["choices"][0]["message"]["content"].startswith(opening)
    assert len(chat["choices"][0]["message"]["content"]) > len(opening)


def test_several_prompts_one_choice_each_in_order(sim_server: InProcessSluice) -> None:
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]
    reply = _post(
        sim_server, "/v1/completions", json={"prompt": prompts, "max_tokens": 3, "n": 2, "seed": 2}
    ).json()
    assert [c["index"] for c in reply["choices"]] == list(range(6))  # prompt i: 2i and 2i + 1
    texts = [c["text"] for c in reply["choices"]]
    assert texts[0:2] == texts[4:6]  # the same prompt and seed: the same two answers
    assert reply["usage"]["prompt_tokens"] == 8 and reply["usage"]["completion_tokens"] == 18
    # Streamed as vLLM streams it: one id, choices numbered across the prompts, each chunk
    # one choice's, then one usage chunk with the totals.
    events = _sse_events(
        sim_server,
        "/v1/completions",
        {
            "prompt": prompts,
            "max_tokens": 3,
            "n": 2,
            "seed": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert len({event["id"] for event in events}) == 1
    streamed = [""] * 6
    for event in events[:-1]:
        (choice,) = event["choices"]
        streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    assert events[-1]["choices"] == [] and events[-1]["usage"] == reply["usage"]
    # A part refused before the stream began: the refusal is the answer, nothing is held.
    too_long = _post(
        sim_server,
        "/v1/completions",
        json={"prompt": [[5] * 3, [5] * 100_000], "max_tokens": 3, "stream": True},
    )
    assert _assert_error(too_long, 400, "context_length_exceeded")["param"] == "prompt"
    wait_at_zero(
        sim_server,
        "sluice_budget_in_use",
        "sluice_engine_unfinished_requests",
        timeout=5,
        message="the first part, admitted, is cancelled with the refusal",
    )


def test_reasoning_effort_and_documents_reach_the_template_as_vllm_passes_them() -> None:
    parsed = parse_request(
        {**CHAT, "reasoning_effort": "none", "documents": [{"title": "t", "text": "x"}]}, "chat"
    )
    assert parsed.template_kwargs == {
        "documents": [{"title": "t", "text": "x"}],
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    chosen = parse_request(
        {**CHAT, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
        "chat",
    )
    assert chosen.template_kwargs == {"enable_thinking": False, "reasoning_effort": "high"}
