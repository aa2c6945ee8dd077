"""Anthropic's tool use on the real vLLM engine, with the official `anthropic` SDK: a named
tool choice (a schema the engine enforces) answered as a `tool_use` block, whole and streamed,
a conversation with `tool_use` and `tool_result` blocks through the model's own chat
template, and structured outputs (`output_config.format`) enforced by the engine."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import jsonschema
import pytest
from conftest import WEATHER, WEATHER_ASK, SluiceProcess

# `anthropic` (~2 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import anthropic

MODEL = "sluice-demo"
TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}
NAMED = {"type": "tool", "name": "get_weather"}


def prompt_tokens(usage: anthropic.types.Usage) -> int:
    """The whole prompt's tokens: Anthropic's input_tokens leave out those read from the cache
    (vLLM's prefix cache may hold a conversation's beginning)."""
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


@pytest.fixture
def client(vllm_server: SluiceProcess) -> anthropic.Anthropic:
    import anthropic

    return anthropic.Anthropic(base_url=vllm_server.url, api_key="unused", max_retries=0)


def test_a_named_tool_is_a_tool_use_block_whole_and_streamed(client: anthropic.Anthropic) -> None:
    # (greedy: this SDK has no `temperature` argument, the body still takes it)
    ask = {"model": MODEL, "max_tokens": 64, "messages": WEATHER_ASK, "tools": [TOOL]}
    greedy = {"temperature": 0}
    whole = client.messages.create(**ask, tool_choice=NAMED, extra_body=greedy)
    assert whole.stop_reason == "tool_use"
    (call,) = [block for block in whole.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)

    with client.messages.stream(**ask, tool_choice=NAMED, extra_body=greedy) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    (streamed_call,) = [block for block in streamed.content if block.type == "tool_use"]
    # Greedy both times: the input_json_delta pieces make the same input as the whole reply.
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    # The call and its result, sent back as blocks, go through the model's chat template.
    conversation = [
        *WEATHER_ASK,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny."}],
        },
    ]
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=[TOOL])
    answer = client.messages.create(
        model=MODEL, max_tokens=4, messages=conversation, tools=[TOOL], tool_choice={"type": "none"}
    )
    assert prompt_tokens(answer.usage) == counted.input_tokens > prompt_tokens(whole.usage)


def test_an_output_format_makes_the_text_a_document_of_its_schema(
    client: anthropic.Anthropic,
) -> None:
    config = {"format": {"type": "json_schema", "schema": WEATHER}}
    answer = client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=WEATHER_ASK,
        output_config=config,  # type: ignore[arg-type]
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason == "end_turn"  # the schema's grammar ends the text
    (block,) = answer.content
    assert block.type == "text"
    jsonschema.validate(json.loads(block.text), WEATHER)
