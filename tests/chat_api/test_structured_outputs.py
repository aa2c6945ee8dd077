"""Structured outputs and tool calls with the official `openai` client, on the real vLLM engine.

The session server reads tool calls with vLLM's `pythonic` parser and allows no free whitespace
in JSON (see conftest). The demo model's weights are random, so a constraint is what makes its
output meaningful here: what comes back must parse, match the schema, and arrive in OpenAI's
shapes, streamed or whole, over SSE or the WebSocket.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
import websockets
from conftest import WEATHER, WEATHER_ASK, SluiceProcess

# `openai` (~0.5 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

MODEL = "sluice-demo"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Forces the model to write a call in the pythonic parser's syntax, so `auto` has one to find.
PYTHONIC_CALL = {"regex": r"\[get_weather\(city='(Paris|Rome)', sunny=(True|False)\)\]"}


@pytest.fixture
def client(vllm_server: SluiceProcess) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0)


def streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    """Tool calls put together from their deltas (id and name first, arguments in pieces),
    and the finish_reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert choice.delta.content in (None, ""), "a tool call's text is not content"
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_a_named_tool_call_matches_the_tool_schema(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": WEATHER_ASK,
        "tools": [TOOL],
        "tool_choice": NAMED,
        "max_tokens": 64,
        "temperature": 0,
    }
    reply = client.chat.completions.create(**ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's for a named function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    chunks = list(client.chat.completions.create(**ask, stream=True))
    (streamed,), finish = streamed_calls(chunks)
    assert finish == "stop"
    assert streamed["name"] == "get_weather" and streamed["id"]
    # Greedy both times: the streamed pieces make the same arguments as the whole reply.
    assert streamed["arguments"] == call.function.arguments


def test_required_tool_choice_calls_a_tool(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_auto_tool_choice_reads_calls_with_the_configured_parser(client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "messages": WEATHER_ASK,
        "tools": [TOOL],
        "max_tokens": 64,
        "temperature": 0,
        "extra_body": {"structured_outputs": PYTHONIC_CALL},
    }
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)

    (streamed,), finish = streamed_calls(list(client.chat.completions.create(**body, stream=True)))
    assert finish == "tool_calls"
    assert streamed["name"] == "get_weather"
    assert json.loads(streamed["arguments"]) == arguments


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        tools=[TOOL],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content and choice.message.tool_calls is None  # absent, as OpenAI


def test_json_schema_response_format_gives_valid_json(client: openai.OpenAI) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        response_format=response_format,
        max_tokens=64,
        temperature=0.8,
        seed=3,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=WEATHER_ASK,
            response_format=response_format,
            max_tokens=64,
            temperature=0.8,
            seed=3,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text) == json.loads(reply.choices[0].message.content or "")


def test_vllm_structured_outputs_on_both_endpoints(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_ASK,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert choice.choices[0].message.content in ("sunny", "rainy")
    completion = client.completions.create(
        model=MODEL,
        prompt="The code is",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}-[A-F]{2}"}},
    )
    assert re.fullmatch("[0-9]{4}-[A-F]{2}", completion.choices[0].text)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "odd"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "elsewhere"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to choose from
    ],
)
def test_bad_constraints_are_400s_before_anything_is_queued(
    vllm_server: SluiceProcess,
    client: openai.OpenAI,
    fields: dict[str, Any],
    param: str,
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=WEATHER_ASK, max_tokens=4, extra_body=fields
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_request", error
    assert error["param"] == param, error
    assert vllm_server.metric("sluice_budget_in_use", budget="sequences") == 0


async def test_tool_call_deltas_over_the_websocket(vllm_server: SluiceProcess) -> None:
    ws_url = vllm_server.url.replace("http://", "ws://") + "/v1/ws"
    request = {
        "messages": WEATHER_ASK,
        "tools": [TOOL],
        "tool_choice": NAMED,
        "max_tokens": 64,
        "temperature": 0,
    }
    arguments, names, final = "", [], None
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "w", "request": request}))
        while final is None:
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert message["type"] in ("delta", "final"), message
            if message["type"] == "final":
                final = message
                continue
            assert message["text"] == ""  # the call is not content
            for call in message.get("tool_calls", ()):
                names.append(call["function"].get("name"))
                arguments += call["function"].get("arguments") or ""
    assert final["finish_reason"] == "stop"
    assert [n for n in names if n] == ["get_weather"]
    jsonschema.validate(json.loads(arguments), WEATHER)
