"""OpenAI's Responses API on the real vLLM engine, with the official `openai` SDK: a response
whole and streamed, a background response retrieved and its stream resumed after a sequence
number, a background response cancelled (its engine request aborted), function tools
(named and required) and `text.format` JSON schemas enforced by the engine, and a
conversation whose second turn finds its first turn's prompt in the engine's prefix cache.

The demo model's greedy text never ends by itself (`engine_adapters.demo_model`), so a greedy
response runs to its `max_output_tokens` and the same input gives the same text, whole or
streamed, on any CPU."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest
from conftest import WEATHER, SluiceProcess, wait_until

# `openai` (~1 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

MODEL = "sluice-demo"
BLOCK = 128  # vLLM's KV block on CPU: only whole blocks are cached
DEADLINE_S = 60.0
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}


@pytest.fixture
def client(vllm_server: SluiceProcess) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.responses.create(**GREEDY, input="tell me a story", max_output_tokens=16)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 16
    assert whole.output_text

    events = list(
        client.responses.create(
            **GREEDY, input="tell me a story", max_output_tokens=16, stream=True
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text  # greedy, decisive: the same text
    assert final.usage is not None and final.usage.model_dump() == whole.usage.model_dump()


def test_a_background_response_is_retrieved_and_its_stream_resumed(
    client: openai.OpenAI,
) -> None:
    made = client.responses.create(
        **GREEDY, input="tell me a story", max_output_tokens=400, background=True
    )
    assert made.background is True and made.status in ("queued", "in_progress")
    seen = []
    with client.responses.retrieve(made.id, stream=True) as first:
        for event in first:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 6:
                break  # the client leaves mid-generation; a background response runs on
    after = seen[-1].sequence_number
    rest = list(client.responses.retrieve(made.id, stream=True, starting_after=after))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # every remaining event once, in order
    final = rest[-1]
    assert final.type == "response.incomplete"
    deltas = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    found = client.responses.retrieve(made.id)
    assert deltas == final.response.output_text == found.output_text
    assert found.usage is not None and found.usage.output_tokens == 400
    # The whole stream again, from its start: the same events.
    replay = list(client.responses.retrieve(made.id, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in seen + rest]


def test_a_cancelled_background_response_stops_its_engine_request(
    client: openai.OpenAI, vllm_server: SluiceProcess
) -> None:
    cancelled_before = vllm_server.metric("sluice_requests_total", outcome="cancelled")
    # A long answer, given time enough to be admitted on a slow host too (the class's 30 s
    # deadline refused it where 4,000 tokens were predicted to take 38 s); it is cancelled
    # as soon as it starts.
    made = client.responses.create(
        **GREEDY,
        input="tell me a long story",
        max_output_tokens=4000,
        background=True,
        extra_headers={"X-Request-Timeout-Ms": "600000"},
    )
    deadline = time.monotonic() + DEADLINE_S
    while client.responses.retrieve(made.id).status == "queued":
        assert time.monotonic() < deadline, "the background response never started"
    assert client.responses.cancel(made.id).status == "cancelled"
    found = client.responses.retrieve(made.id)
    assert found.status == "cancelled"
    assert found.usage is None or found.usage.output_tokens < 4000
    wait_until(
        lambda: vllm_server.metric("sluice_requests_total", outcome="cancelled") > cancelled_before,
        DEADLINE_S,
        message="the cancelled response was not recorded as cancelled",
    )
    wait_until(
        lambda: vllm_server.metric("sluice_running_requests") == 0,
        DEADLINE_S,
        message="the engine request ran on after its response was cancelled",
    )


def test_a_named_function_tool_is_a_function_call_item(client: openai.OpenAI) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather now",
        "parameters": WEATHER,
        "strict": True,
    }
    response = client.responses.create(
        **GREEDY,
        input="What is the weather in Paris?",
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)  # the engine kept to the schema

    # The call and its output, sent back as items, go through the model's chat template.
    answer = client.responses.create(
        **GREEDY,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            call.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."},
        ],
        tools=[tool],  # type: ignore[list-item]
        tool_choice="none",
        max_output_tokens=4,
    )
    assert answer.output_text and answer.usage is not None and response.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens


def test_a_required_call_streamed_shows_no_text(client: openai.OpenAI) -> None:
    """`tool_choice: "required"`: the engine writes the calls as a JSON list, whose closing
    `}]` the parser reads as no field of the output; none of it is output text."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    events = list(
        client.responses.create(
            **GREEDY,
            input="What is the weather in Paris?",
            tools=[tool],  # type: ignore[list-item]
            tool_choice="required",
            max_output_tokens=64,
            stream=True,
        )
    )
    assert [e.type for e in events if "output_text" in e.type] == []
    final = events[-1]
    assert final.type == "response.completed"  # the schema's grammar ends the list
    (call,) = final.response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_a_json_schema_text_format_is_kept(client: openai.OpenAI) -> None:
    response = client.responses.create(
        **GREEDY,
        input="The weather in Rome, as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        max_output_tokens=64,
    )
    assert response.status == "completed"  # the schema's grammar ends the text
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_a_conversations_second_turn_finds_its_first_turns_prompt_cached(
    client: openai.OpenAI,
) -> None:
    """The second turn's prompt begins with the first's (the conversation's items render as
    the same messages), so the tenant's cached blocks of it are found again."""
    tag = uuid.uuid4().hex[:8]  # a prompt no earlier test sent: nothing of it cached before
    made = client.conversations.create()
    first = client.responses.create(
        **GREEDY,
        input=" ".join(f"w{tag}x{i}" for i in range(120)),
        conversation=made.id,
        max_output_tokens=8,
    )
    assert first.usage is not None and first.usage.input_tokens >= 2 * BLOCK
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.create(
        **GREEDY, input="and then?", conversation=made.id, max_output_tokens=8
    )
    assert second.usage is not None
    # It saw the first turn: its input and output are in its prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert BLOCK * (first.usage.input_tokens // BLOCK) <= cached <= second.usage.input_tokens
    items = client.conversations.items.list(made.id, order="asc")
    roles = [getattr(item, "role", None) for item in items]
    assert roles == ["user", "assistant", "user", "assistant"]
