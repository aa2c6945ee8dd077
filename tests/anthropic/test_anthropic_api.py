"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the
official `anthropic` SDK against a real server on the sim engine, and its translation into
the chat request Sluice runs."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import orjson
import pytest
from conftest import InProcessSluice, parse_sse, sim_sluice, wait_until

from server.anthropic.messages import parse_count_tokens, parse_messages
from server.anthropic.replies import ERROR_TYPES, MessageStream, error_type, message_reply
from server.anthropic.routes import anthropic_error
from server.core.errors import (
    ERRORS,
    InvalidRequest,
    Overloaded,
    TenantQuotaExceeded,
    UnsupportedParameter,
)
from server.generations.usage import usage
from server.openai_wire.wire import ignored_fields

# `anthropic` (~2 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import anthropic

# One worker runs the module: one server, one import of `anthropic`.
pytestmark = pytest.mark.xdist_group("anthropic")
KEY = "sk-anthropic-5e1c0d"
HELLO = [{"role": "user", "content": "Tell me about the sea."}]


def prompt_tokens(counts: anthropic.types.Usage) -> int:
    """The whole prompt's tokens: Anthropic's input_tokens leave out those read from, or
    written to, the cache."""
    return (
        counts.input_tokens
        + (counts.cache_read_input_tokens or 0)
        + (counts.cache_creation_input_tokens or 0)
    )


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"])


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """The sim engine with one tenant's key; its access log at info, in its log file."""
    root = tmp_path_factory.mktemp("anthropic")
    tenant = f"tenants:\n  acme: {{api_keys: [{KEY}]}}\n"
    with sim_sluice(root, "--log-level", "info", config=tenant) as server:
        yield server


@pytest.fixture(scope="module")
def client(keyed: InProcessSluice) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(keyed: InProcessSluice) -> str:
    return _model(keyed.url)


def test_create_answers_a_message_cut_at_max_tokens(
    client: anthropic.Anthropic, model: str, keyed: InProcessSluice
) -> None:
    import anthropic

    before = keyed.metric("sluice_requests_total", outcome="completed")
    message = client.messages.create(
        model=model,
        max_tokens=12,
        system="You are terse.",
        messages=HELLO,
        extra_body={"ignore_eos": True},
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == model
    assert [block.type for block in message.content] == ["text"]
    text = message.content[0]
    assert isinstance(text, anthropic.types.TextBlock) and text.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 12 and message.usage.input_tokens > 0
    # The same request as chat: one lifecycle, the same prompt and the same metrics.
    assert keyed.metric("sluice_requests_total", outcome="completed") == before + 1
    log = keyed.log()
    assert '"api":"messages"' in log and '"tenant":"acme"' in log


def test_stream_events_add_up_to_the_final_message(client: anthropic.Anthropic, model: str) -> None:
    with client.messages.stream(
        model=model, max_tokens=16, messages=HELLO, extra_body={"ignore_eos": True}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and [block.type for block in final.content] == ["text"]
    assert final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16
    whole = client.messages.create(model=model, max_tokens=1, messages=HELLO)
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)


def test_stream_events_come_in_anthropics_order(keyed: InProcessSluice, model: str) -> None:
    body = {"model": model, "max_tokens": 5, "messages": HELLO, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST",
        keyed.url + "/v1/messages",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(data) for _, data in parse_sse(lines)]
    assert [d["type"] for d in datas] == names  # each event's name is its data's type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["content"] == [] and datas[0]["message"]["usage"]["input_tokens"]
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # message_start's usage came before the engine looked the prompt up in its cache;
    # message_delta's is the whole message's (the SDK's final message takes it).
    assert "cache_read_input_tokens" not in datas[0]["message"]["usage"]
    assert datas[-2]["usage"]["output_tokens"] == 5
    assert set(datas[-2]["usage"]) == {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
    }


def test_count_tokens_is_the_prompt_a_create_is_charged_for(
    client: anthropic.Anthropic, model: str
) -> None:
    conversation = [
        *HELLO,
        {"role": "assistant", "content": [{"type": "text", "text": "It is wide."}]},
        {"role": "user", "content": "And deep?"},
    ]
    counted = client.messages.count_tokens(
        model=model, system=[{"type": "text", "text": "Be brief."}], messages=conversation
    )
    made = client.messages.create(
        model=model,
        max_tokens=2,
        system=[{"type": "text", "text": "Be brief."}],
        messages=conversation,
    )
    assert counted.input_tokens == prompt_tokens(made.usage) > 0


def test_a_long_prompt_sent_again_is_read_from_the_cache_whole_and_streamed(
    client: anthropic.Anthropic, model: str
) -> None:
    """Whole blocks of 128 tokens (the sim's) are cached: the second request reads them, and
    its input_tokens are the rest of its prompt."""
    tag = uuid.uuid4().hex[:8]
    messages = [{"role": "user", "content": " ".join(f"w{tag}x{i}" for i in range(424))}]
    first = client.messages.create(model=model, max_tokens=2, messages=messages)
    assert first.usage.cache_read_input_tokens == 0 == first.usage.cache_creation_input_tokens
    whole = prompt_tokens(first.usage)
    assert first.usage.input_tokens == whole > 3 * 128
    again = client.messages.create(model=model, max_tokens=2, messages=messages)
    with client.messages.stream(model=model, max_tokens=2, messages=messages) as stream:
        streamed = stream.get_final_message()
    for message in (again, streamed):
        hit = message.usage.cache_read_input_tokens
        assert hit is not None and 3 * 128 <= hit < whole
        assert message.usage.input_tokens == whole - hit
        assert message.usage.cache_creation_input_tokens == 0


def test_a_missing_max_tokens_is_a_bad_request(client: anthropic.Anthropic, model: str) -> None:
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as refused:
        # (with a timeout of its own: the SDK's default is computed from max_tokens)
        client.messages.create(
            model=model,
            messages=HELLO,
            max_tokens=anthropic.omit,  # type: ignore[arg-type]
            timeout=30,
        )
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


def test_an_unknown_model_is_not_found(client: anthropic.Anthropic) -> None:
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model="claude-nonesuch", max_tokens=4, messages=HELLO)
    assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_a_wrong_x_api_key_is_refused_and_the_right_one_accepted(
    keyed: InProcessSluice, model: str
) -> None:
    import anthropic

    wrong = anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=model, max_tokens=4, messages=HELLO)
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=model, messages=HELLO)
    bearer = httpx.post(
        keyed.url + "/v1/messages",
        json={"model": model, "max_tokens": 2, "messages": HELLO},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"


def test_tools_the_engine_cannot_call_are_refused_as_chat_refuses_them(
    client: anthropic.Anthropic, model: str, keyed: InProcessSluice
) -> None:
    import anthropic

    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    chat_tools = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    named = {"type": "function", "function": {"name": "weather"}}
    for choice, chat_choice in (
        (None, None),
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "weather"}, named),
    ):
        extra = {} if choice is None else {"tool_choice": choice}
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=model, max_tokens=4, messages=HELLO, tools=tools, **extra)  # type: ignore[call-overload]
        error = refused.value.body["error"]  # type: ignore[index]
        chat_body = {"model": model, "max_tokens": 4, "messages": HELLO, "tools": chat_tools}
        if chat_choice is not None:
            chat_body["tool_choice"] = chat_choice
        chat = httpx.post(
            keyed.url + "/v1/chat/completions", json=chat_body, headers={"x-api-key": KEY}
        )
        assert chat.status_code == 400
        assert error == {
            "type": "invalid_request_error",
            "message": chat.json()["error"]["message"],
        }
    # Shown to the template but not called: served.
    shown = client.messages.create(
        model=model, max_tokens=4, messages=HELLO, tools=tools, tool_choice={"type": "none"}
    )
    assert shown.stop_reason in ("end_turn", "max_tokens")


def test_an_image_block_is_refused_naming_it(client: anthropic.Anthropic, model: str) -> None:
    import anthropic

    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    assert "'image' content blocks are not supported" in refused.value.message


def test_a_refusal_before_the_stream_keeps_its_status_and_retry_after(
    client: anthropic.Anthropic, model: str
) -> None:
    import anthropic

    with pytest.raises(anthropic.APIStatusError) as refused:
        with client.messages.stream(
            model=model,
            max_tokens=3000,
            messages=HELLO,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Timeout-Ms": "300"},  # far too soon for 3,000 tokens
        ) as stream:
            stream.get_final_message()
    assert refused.value.status_code == 503
    assert refused.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_an_idempotency_key_answers_with_the_same_message(
    client: anthropic.Anthropic, model: str
) -> None:
    import anthropic

    key = {"Idempotency-Key": "anthropic-once"}
    first = client.messages.with_raw_response.create(
        model=model, max_tokens=6, messages=HELLO, extra_headers=key
    )
    again = client.messages.with_raw_response.create(
        model=model, max_tokens=6, messages=HELLO, extra_headers=key
    )
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().model_dump() == first.parse().model_dump()
    with pytest.raises(anthropic.UnprocessableEntityError):
        client.messages.create(model=model, max_tokens=7, messages=HELLO, extra_headers=key)


def test_nothing_leaks_after_bad_input_or_a_client_that_leaves(
    keyed: InProcessSluice, client: anthropic.Anthropic, model: str
) -> None:
    for body in (
        {"model": model, "max_tokens": 0, "messages": HELLO},
        {
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "word " * 5000}],
        },
        {
            "model": model,
            "max_tokens": 4,
            "messages": HELLO,
            "tools": [{"name": "f", "input_schema": {}}],
        },
    ):
        response = httpx.post(keyed.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
        assert response.status_code == 400 and response.json()["type"] == "error"
    # A deadline of its own: on a busy host, 3,000 tokens were once predicted past the default
    # 30 s and refused (503), where this test is about a client that leaves.
    with client.messages.stream(
        model=model,
        max_tokens=3000,
        messages=HELLO,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Timeout-Ms": "600000"},
    ) as stream:
        next(iter(stream.text_stream))  # the first piece, then the client leaves

    def released() -> bool:
        return all(
            keyed.metric(name) == 0
            for name in (
                "sluice_running_requests",
                "sluice_queue_depth",
                "sluice_budget_in_use",
                "sluice_engine_unfinished_requests",
            )
        )

    wait_until(released, 60, message="the run that lost its client is released")
    assert keyed.metric("sluice_requests_total", outcome="cancelled") >= 1


# -- the translation and the rendering, without a server ----------------------------------


def test_tools_and_tool_blocks_become_the_chat_request() -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "sys"}],
        "stop_sequences": ["END"],
        "top_k": 0,
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "weather",
                        "input": {"at": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                    {"type": "text", "text": "So?"},
                ],
            },
        ],
        "tools": [{"name": "weather", "description": "now", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
    }
    _, chat, parsed = parse_messages(body)
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"at":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": [{"type": "text", "text": "So?"}]},
    ]
    assert parsed.kind == "chat" and parsed.max_tokens == 9
    assert parsed.sampling == {"stop": ("END",), "top_k": -1}
    assert parsed.output == {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "now",
                    "parameters": {"type": "object"},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
    }
    for choice, chat_choice in (({"type": "any"}, "required"), ({"type": "none"}, "none")):
        _, chat, _ = parse_messages({**body, "tool_choice": choice})
        assert chat["tool_choice"] == chat_choice
    # count_tokens reads the same body's prompt
    _, counted, _ = parse_count_tokens(body)
    assert counted["messages"] == chat["messages"] and counted["tools"] == chat["tools"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {
                "role": "user",
                "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
            },
            "messages[0].content[0]",
        ),
        (
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
            "messages[0].content[0]",
        ),
        ({"role": "system", "content": "hi"}, "messages[0].role"),
    ],
)
def test_blocks_in_the_wrong_role_are_refused(message: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_messages({"model": "m", "max_tokens": 1, "messages": [message]})
    assert refused.value.param == param


def test_output_config_becomes_the_chat_response_format_and_effort() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    _, chat, parsed = parse_messages(
        {"model": "m", "max_tokens": 1, "messages": HELLO, "output_config": config}
    )
    assert chat["reasoning_effort"] == "low"
    assert parsed.output == {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }
    }
    with pytest.raises(InvalidRequest) as refused:
        parse_messages(
            {
                "model": "m",
                "max_tokens": 1,
                "messages": HELLO,
                "output_config": {"format": {"type": "regex", "schema": {}}},
            }
        )
    assert refused.value.param == "output_config.format.type"


def test_an_undeclared_field_is_ignored_and_thinking_refused() -> None:
    request, _, _ = parse_messages({"model": "m", "max_tokens": 1, "messages": HELLO, "x": 1})
    assert ignored_fields(request) == ("x",)
    with pytest.raises(UnsupportedParameter) as refused:
        parse_messages({"model": "m", "max_tokens": 1, "messages": HELLO, "thinking": {}})
    assert refused.value.param == "thinking"


def test_a_whole_chat_body_becomes_a_message_with_tool_use() -> None:
    chat = {
        "model": "m",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"at": "Oslo"}'},
                        }
                    ],
                },
                "finish_reason": "stop",  # a named tool's call
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    reply = message_reply(chat, "msg_1")
    assert reply["content"] == [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"at": "Oslo"}},
    ]
    assert reply["stop_reason"] == "tool_use"
    # Anthropic's input_tokens are those not read from the cache.
    assert reply["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 3,
    }
    chat["choices"][0]["message"] = {"role": "assistant", "content": "x"}
    chat["choices"][0]["stop_reason"] = "END"
    assert (
        message_reply(chat, "msg_1")["stop_reason"],
        message_reply(chat, "m")["stop_sequence"],
    ) == (
        "stop_sequence",
        "END",
    )


def _events(data: bytes) -> list[dict]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def test_a_streamed_tool_call_is_a_tool_use_block_with_json_deltas() -> None:
    stream = MessageStream("msg_1", "m", 7)
    data = stream.start() + stream.text("Checking.")
    data += stream.fields(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        }
    )
    data += stream.fields({"tool_calls": [{"index": 0, "function": {"arguments": '{"at": '}}]})
    data += stream.fields({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]})
    data += stream.finish("tool_calls", None, usage(7, 9, 0))
    events = _events(data)
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert events[3] == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Checking."},
    }
    assert events[5]["index"] == 1 and events[5]["content_block"] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "weather",
        "input": {},
    }
    json_parts = [e["delta"]["partial_json"] for e in events[6:8]]
    assert json.loads("".join(json_parts)) == {"at": "Oslo"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] == 9


def test_every_error_has_an_anthropic_type_and_capacity_keeps_retry_after() -> None:
    known = set(ERROR_TYPES.values())
    for cls in ERRORS.values():
        assert error_type(cls("x")) in known
    assert error_type(InvalidRequest("x")) == "invalid_request_error"
    assert error_type(Overloaded("x")) == "overloaded_error"
    for error, status in (
        (Overloaded("busy", retry_after=3), 503),
        (TenantQuotaExceeded("q", retry_after=2), 429),
    ):
        response = anthropic_error(error)
        assert response.status_code == status and response.headers["retry-after"]
        body = orjson.loads(response.body)
        assert body == {
            "type": "error",
            "error": {"type": error_type(error), "message": error.message},
        }


def test_the_routes_are_in_the_openapi_document(keyed: InProcessSluice) -> None:
    paths = httpx.get(keyed.url + "/openapi.json", timeout=60).json()["paths"]
    assert "/v1/messages" in paths and "/v1/messages/count_tokens" in paths
