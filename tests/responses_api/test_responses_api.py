"""OpenAI's Responses API (`/v1/responses`), called with the official `openai` SDK as a user
would: answered whole and streamed, stored per tenant and retrieved, continued with
`previous_response_id`, run in the background (polled, cancelled, its events streamed again
from a sequence number), and bad input refused with OpenAI's error shape.

A real Sluice server on loopback, in this process, on the sim engine (steps of ~10 ms, so that
a background response runs long enough to be cancelled or left mid-stream)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import FAST_SIM, InProcessSluice, sim_sluice, wait_until

from server.generations.log import Event, Kind
from server.generations.ports import ResponseStore, StoredResponse
from server.responses_api.service import feed
from server.responses_api.store import SqliteResponses
from server.responses_api.wire import CreateResponse, ResponseBuilder

# `openai` (~1 s to import) in the tests that call it: every pytest-xdist worker collects
# this module, and most never run them.
if TYPE_CHECKING:
    import openai

# One worker runs the module: its two servers start once.
pytestmark = pytest.mark.xdist_group("responses")
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
DEADLINE_S = 30.0


def serve(root: Path, *more: str, paced: bool = True, log: str = "server.log") -> InProcessSluice:
    """A sim server with `KEYS`, `paced` at 10 ms a step (for tests that catch a stream
    mid-way), else as fast as the sim runs (`FAST_SIM`)."""
    pace = ["--sim-step-base-ms", "10"] if paced else FAST_SIM
    return sim_sluice(root, *pace, *more, keys=KEYS, log=log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """Its answers run to their max_output_tokens (the sim's model never stops by itself)."""
    with serve(tmp_path_factory.mktemp("responses")) as server:
        yield server


@pytest.fixture(scope="module")
def stopping_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """Its model stops by itself (a chance of 1 in 20 each token): answers complete. Unpaced:
    its tests read whole answers (the sampling test 800 tokens, 8 s at 10 ms a step, 1.5 s at
    the sim model's default speed)."""
    root = tmp_path_factory.mktemp("stopping")
    with serve(root, "--sim-eos-probability", "0.05", paced=False) as server:
        yield server


def client_of(server: InProcessSluice, key: str = "sk-acme") -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(server: InProcessSluice) -> openai.OpenAI:
    return client_of(server)


def test_a_whole_response(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="sim", input="tell me a story", max_output_tokens=24, temperature=0.5
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > 0
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == 24


def test_a_streamed_response(stopping_server: InProcessSluice) -> None:
    stream = client_of(stopping_server).responses.create(
        model="sim",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "a story"}]}],
        instructions="be brief",
        max_output_tokens=400,
        stream=True,
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1]
    assert final.type == "response.completed", final.type
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.response.output_text
    assert final.response.usage is not None and final.response.usage.output_tokens > 0
    assert final.response.instructions == "be brief"


def test_the_sdks_stream_helper_assembles_the_response(stopping_server: InProcessSluice) -> None:
    with client_of(stopping_server).responses.stream(
        model="sim", input="a story", max_output_tokens=400
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas != ""


def test_a_client_leaving_a_stream_cancels_its_generation(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    def cancelled() -> float:
        return server.metric("sluice_requests_total", outcome="cancelled")

    before = cancelled()
    with client.responses.create(
        model="sim", input="tell me a story", max_output_tokens=600, stream=True
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    wait_until(lambda: cancelled() > before, DEADLINE_S, message="the generation ran on")


def test_a_stored_response_is_retrieved_by_its_tenant_alone(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    import openai

    made = client.responses.create(model="sim", input="hello", max_output_tokens=8)
    found = client.responses.retrieve(made.id)
    assert found.model_dump() == made.model_dump()
    with pytest.raises(openai.NotFoundError) as refused:
        client_of(server, "sk-globex").responses.retrieve(made.id)
    assert refused.value.body["code"] == "not_found"  # type: ignore[index]
    unstored = client.responses.create(model="sim", input="hi", max_output_tokens=8, store=False)
    assert unstored.store is False and unstored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def long_input() -> str:
    """Three whole blocks of the sim's prefix cache (128 tokens, a token a word) and more, that
    no earlier request sent."""
    tag = uuid.uuid4().hex[:8]
    return " ".join(f"w{tag}x{i}" for i in range(424))


def cached(response: Any) -> int:
    """The response's input tokens found in the engine's prefix cache (a part of its input)."""
    usage = response.usage
    assert usage is not None and 0 <= usage.input_tokens_details.cached_tokens
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    return int(usage.input_tokens_details.cached_tokens)


def test_an_input_sent_again_is_read_from_the_cache_streamed_stored_and_retrieved(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    """The usage's input_tokens_details.cached_tokens in a whole response, a stream's terminal
    event and the stored response alike; another tenant's prefix cache is its own."""
    text = long_input()
    assert cached(client.responses.create(model="sim", input=text, max_output_tokens=2)) == 0
    with client.responses.create(
        model="sim", input=text, max_output_tokens=2, stream=True
    ) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # (max_output_tokens)
    streamed = events[-1].response  # type: ignore[union-attr]
    hit = cached(streamed)
    assert hit >= 3 * 128 and hit % 128 == 0
    assert cached(client.responses.retrieve(streamed.id)) == hit
    assert cached(client.responses.create(model="sim", input=text, max_output_tokens=2)) == hit
    other = client_of(server, "sk-globex")
    assert cached(other.responses.create(model="sim", input=text, max_output_tokens=2)) == 0


def test_previous_response_id_continues_the_conversation(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    import openai

    first = client.responses.create(model="sim", input="tell me a story", max_output_tokens=16)
    second = client.responses.create(
        model="sim", input="and then?", previous_response_id=first.id, max_output_tokens=16
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):  # another tenant's response is none of its own
        client_of(server, "sk-globex").responses.create(
            model="sim", input="and then?", previous_response_id=first.id
        )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"max_output_tokens": -1}, "invalid_request", "max_output_tokens"),
        ({"max_tool_calls": 2}, "unsupported_parameter", "max_tool_calls"),
        ({"temperature": 3}, "invalid_request", "temperature"),
        ({"input": [{"type": "image", "url": "x"}]}, "invalid_request", "input[0]"),
        ({"tools": [{"type": "function", "name": "f"}]}, "unsupported_parameter", "tools"),
        ({"include": ["reasoning.encrypted_content"]}, "unsupported_parameter", "include"),
        ({"top_logprobs": 21}, "invalid_request", "top_logprobs"),
        ({"top_k": -2}, "invalid_request", "top_k"),
        ({"reasoning": {"summary": "detailed"}}, "unsupported_parameter", "reasoning.summary"),
        ({"reasoning": {"effort": "huge"}}, "invalid_request", "reasoning.effort"),
        ({"chat_template_kwargs": {"tools": []}}, "invalid_request", "chat_template_kwargs"),
    ],
)
def test_bad_input_is_a_400_in_openais_shape(
    client: openai.OpenAI, body: dict[str, Any], code: str, param: str
) -> None:
    import openai

    fields = {"input": "hi", **body}
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="sim", extra_body=fields)  # type: ignore[call-overload]
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_vllms_sampling_parameters_and_template_arguments_are_served(
    stopping_server: InProcessSluice,
) -> None:
    """What vLLM's server takes beside OpenAI's fields (`top_k`, `seed`, `ignore_eos`, ...,
    `chat_template_kwargs`, and `reasoning.effort` as the chat's `reasoning_effort`), sent
    as vLLM's own tests send them: through the SDK's `extra_body`."""
    client = client_of(stopping_server)
    ask: dict[str, Any] = dict(model="sim", input="tell me a story", max_output_tokens=200)
    vllms = {"top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True}
    made = client.responses.create(
        **ask,
        reasoning={"effort": "low"},
        extra_body={**vllms, "chat_template_kwargs": {"enable_thinking": False}},
    )
    # (the model stops by itself 1 in 20 tokens: only ignore_eos keeps it to the end)
    assert made.status == "incomplete" and made.usage is not None
    assert made.usage.output_tokens == 200
    assert made.reasoning is not None and made.reasoning.effort == "low"
    texts = [
        client.responses.create(**ask, extra_body={"seed": seed, "ignore_eos": True}).output_text
        for seed in (1, 1, 2)
    ]
    assert texts[0] == texts[1] != texts[2]


def test_vllms_fields_reach_the_chat_request() -> None:
    request = CreateResponse.model_validate(
        {
            "input": "hi",
            "temperature": 0.7,
            "top_k": 40,
            "seed": 42,
            "stop": ["a"],
            "logit_bias": {"3": 1},
            "reasoning": {"effort": "none", "summary": "auto"},
            "chat_template_kwargs": {"enable_thinking": True},
        }
    )
    chat = request.chat_body([])
    assert {key: chat[key] for key in chat if key not in ("messages", "stream")} == {
        "temperature": 0.7,
        "top_k": 40,
        "seed": 42,
        "stop": ["a"],
        "logit_bias": {"3": 1.0},
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert request.echoed()["reasoning"] == {"effort": "none", "summary": "auto"}
    plain = CreateResponse.model_validate({"input": "hi"})
    assert plain.echoed()["reasoning"] == {"effort": None, "summary": None}


def test_refusals_read_as_vllms_and_openais(client: openai.OpenAI) -> None:
    """The words clients (vLLM's tests among them) match, with OpenAI's statuses."""
    import openai

    def refusal(call: Any, error: type[openai.APIStatusError]) -> str:
        with pytest.raises(error) as refused:
            call()
        body = refused.value.body
        assert isinstance(body, dict)
        return str(body["message"])

    made = client.responses.create(model="sim", input="hi", max_output_tokens=4)
    assert (
        refusal(
            lambda: client.responses.create(model="sim", input="hi", background=True, store=False),
            openai.BadRequestError,
        )
        == "background can only be used when `store` is true"
    )
    assert (
        refusal(lambda: client.responses.cancel(made.id), openai.BadRequestError)
        == "Cannot cancel a synchronous response."
    )
    assert (
        refusal(lambda: client.responses.retrieve("resp_none"), openai.NotFoundError)
        == "Response with id 'resp_none' not found."
    )


def test_included_logprobs_come_with_the_text(client: openai.OpenAI) -> None:
    """`include: ["message.output_text.logprobs"]` (what the Vercel AI SDK sends for its
    `logprobs` option): each output token's, with `top_logprobs` alternatives, in the response
    and in its stream's deltas; none without it."""
    ask: dict[str, Any] = dict(model="sim", input="tell me a story", max_output_tokens=6)
    made = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=2)
    part = made.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert made.usage is not None and len(part.logprobs) == made.usage.output_tokens
    assert "".join(entry.token for entry in part.logprobs) == part.text
    for entry in part.logprobs:
        assert [top.token for top in entry.top_logprobs][:1] == [entry.token]  # the sim's best
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
    assert made.top_logprobs == 2
    events = list(
        client.responses.create(
            **ask, include=["message.output_text.logprobs"], top_logprobs=1, stream=True
        )
    )
    streamed = [
        entry.token
        for event in events
        if event.type == "response.output_text.delta"
        for entry in event.logprobs
    ]
    final = events[-1].response  # type: ignore[union-attr]
    whole = final.output[0].content[0].logprobs
    assert streamed == [entry.token for entry in whole] and streamed
    plain = client.responses.create(**ask)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_the_logprobs_an_event_carries_are_those_when_it_was_made() -> None:
    """The output text part grows in place: each event holds its own copy of it."""
    from engine_adapters.protocol import TokenLogprob

    builder = ResponseBuilder("resp_x", "m", 0, {})
    builder.start()
    first = builder.text("a", [TokenLogprob("a", -0.5, (("a", -0.5),))])
    later = builder.text("b", [TokenLogprob("b", -1.0)])
    added = next(e for e in first if e["type"] == "response.content_part.added")
    assert added["part"]["logprobs"] == [] and first[-1]["logprobs"][0]["token"] == "a"
    assert later[-1]["logprobs"] == [
        {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []}
    ]
    done = builder.finish("stop", {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    text_done = next(e for e in done if e["type"] == "response.output_text.done")
    assert [entry["token"] for entry in text_done["logprobs"]] == ["a", "b"]


def test_an_idempotency_key_is_refused_not_ignored(client: openai.OpenAI) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="sim", input="hi", extra_headers={"Idempotency-Key": "k"})
    assert refused.value.body["param"] == "Idempotency-Key"  # type: ignore[index]


def test_a_background_response_runs_to_its_end(client: openai.OpenAI) -> None:
    made = client.responses.create(
        model="sim", input="tell me a story", max_output_tokens=40, background=True
    )
    assert made.status in ("queued", "in_progress") and made.background is True
    found = made
    deadline = time.monotonic() + DEADLINE_S
    while found.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not end"
        found = client.responses.retrieve(made.id)
    assert found.status in ("completed", "incomplete") and found.output_text
    assert found.usage is not None and 0 < found.usage.output_tokens <= 40


def test_a_background_response_is_cancelled(client: openai.OpenAI) -> None:
    made = client.responses.create(
        model="sim", input="tell me a story", max_output_tokens=600, background=True
    )
    cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(made.id).status == "cancelled"


def test_a_background_stream_resumes_after_a_sequence_number(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    # The engine held, a step for each event read: it runs on after the client leaves.
    with server.held_steps() as steps:
        made = client.responses.create(
            model="sim", input="tell me a story", max_output_tokens=120, background=True
        )
        seen = []
        with client.responses.retrieve(made.id, stream=True) as first:
            for event in first:
                seen.append(event)
                if event.type == "response.output_text.delta" and len(seen) >= 8:
                    break  # the client leaves mid-generation
                steps.step()
        assert client.responses.retrieve(made.id).status == "in_progress"  # it runs on
        steps.run()
        after = seen[-1].sequence_number
        rest = list(client.responses.retrieve(made.id, stream=True, starting_after=after))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # every event once, in order
    final = rest[-1]
    assert final.type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert deltas == final.response.output_text == client.responses.retrieve(made.id).output_text


def test_a_stored_response_outlives_its_server(tmp_path: Path) -> None:
    """Two lifetimes of a server on one data directory: what the first stored, the second
    finds (retrieved, continued, a background one's events streamed again)."""
    import openai

    data = ["--data-dir", str(tmp_path / "data")]
    # Unpaced: the test reads whole answers and stored events, never a stream caught mid-way.
    for lifetime in ("first", "second"):
        (tmp_path / lifetime).mkdir()
    with serve(tmp_path / "first", *data, paced=False) as first:
        client = client_of(first)
        made = client.responses.create(model="sim", input="tell me a story", max_output_tokens=16)
        background = client.responses.create(
            model="sim", input="a story", max_output_tokens=24, background=True
        )
        with client.responses.retrieve(background.id, stream=True) as stream:
            events = list(stream)
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert client.responses.retrieve(background.id).status == events[-1].response.status
    with serve(tmp_path / "second", *data, paced=False) as second:
        client = client_of(second)
        assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
        after = client.responses.create(
            model="sim", input="and then?", previous_response_id=made.id, max_output_tokens=16
        )
        assert made.usage is not None and after.usage is not None
        assert after.usage.input_tokens >= made.usage.input_tokens + made.usage.output_tokens
        rest = list(client.responses.retrieve(background.id, stream=True, starting_after=3))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[4:]]
        with pytest.raises(openai.NotFoundError):
            client_of(second, "sk-globex").responses.retrieve(made.id)


def test_the_request_becomes_a_chat_request() -> None:
    """Tools, a JSON schema, function calls and their outputs, as the chat request has them
    (the sim engine serves plain text only: vLLM's tools and schemas are the chat's)."""
    request = CreateResponse.model_validate(
        {
            "instructions": "use tools",
            "input": [
                {"role": "developer", "content": "be exact"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True}},
        }
    )
    chat = request.chat_body([{"role": "user", "content": "before"}])
    assert chat["messages"] == [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "before"},
        {"role": "system", "content": "be exact"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {}, "strict": True},
    }


def test_reasoning_is_a_reasoning_item_before_the_answer() -> None:
    """A reasoning parser's output (a run's `reasoning` fields) as OpenAI's `reasoning` item
    and its `response.reasoning_text.*` events, each event and the response as the `openai`
    SDK's types read them; a next turn's conversation leaves it out (as vLLM's server)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    builder = ResponseBuilder("resp_x", "m", 0, CreateResponse(input="hi").echoed())
    events = builder.start()
    pieces = [
        Event(Kind.PIECE, text="<think>Let me", fields={"reasoning": "Let me"}),
        Event(
            Kind.PIECE, text=" think.</think>Hi", fields={"reasoning": " think.", "content": "Hi"}
        ),
        Event(Kind.PIECE, text="}]"),  # a piece the parser made no field of: none of the output
    ]
    for piece in pieces:
        events += feed(builder, piece, parsed=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    events += builder.finish("stop", usage)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "reasoning_text.delta",
        "reasoning_text.delta",
        "reasoning_text.done",
        "content_part.done",
        "output_item.done",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    sdk_events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert sdk_events[6].type == "response.reasoning_text.done"
    assert sdk_events[6].text == "Let me think." and sdk_events[6].item_id == "rs_x_0"
    response = Response.model_validate(builder.snapshot())
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [part.text for part in reasoning.content] == ["Let me think."]
    assert message.type == "message" and response.output_text == "Hi"
    assert builder.conversation() == [{"role": "assistant", "content": "Hi"}]


def test_reasoning_sent_back_is_the_assistants_reasoning() -> None:
    """An earlier output sent back as input, reasoning items included (as clients chain
    turns): each reasoning item and the answer or calls after it, one assistant turn."""
    request = CreateResponse.model_validate(
        {
            "input": [
                {"role": "user", "content": "hi"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "think"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "hello", "annotations": []}],
                },
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "again"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "42"},
            ]
        }
    )
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert request.messages() == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "hello",
            "reasoning": "think",
            "reasoning_content": "think",
        },
        {
            "role": "assistant",
            "content": "",
            "reasoning": "again",
            "reasoning_content": "again",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]


def test_a_reasoning_item_is_served_and_encrypted_reasoning_refused(client: openai.OpenAI) -> None:
    import openai

    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "hm"}],
    }
    made = client.responses.create(
        model="sim",
        input=[{"role": "user", "content": "hi"}, thought],  # type: ignore[list-item]
        max_output_tokens=4,
    )
    assert made.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model="sim",
            input=[{**thought, "encrypted_content": "gAAA"}],  # type: ignore[list-item]
            max_output_tokens=4,
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_parameter"
    assert error["param"] == "input[0].encrypted_content"


def test_tool_calls_become_function_call_items() -> None:
    builder = ResponseBuilder("resp_x", "m", 0, {})
    events = builder.start()
    events += builder.tool_calls([{"index": 0, "id": "c1", "function": {"name": "f"}}])
    events += builder.tool_calls([{"index": 0, "function": {"arguments": '{"a":'}}])
    events += builder.tool_calls([{"index": 0, "function": {"arguments": " 1}"}}])
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    events += builder.finish("tool_calls", usage)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert builder.snapshot()["output"] == [
        {
            "type": "function_call",
            "id": "fc_x_0",
            "call_id": "c1",
            "name": "f",
            "arguments": '{"a": 1}',
            "status": "completed",
        }
    ]
    assert builder.status == "completed"
    assert builder.conversation()[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


async def test_the_store_keeps_responses_for_their_retention_within_each_tenants_bytes(
    tmp_path: Path,
) -> None:
    now = [1_000.0]
    store = SqliteResponses(tmp_path, retention_seconds=10, max_bytes=2_000, clock=lambda: now[0])
    try:
        await check_bounds(store, now)
    finally:
        store.close()


async def check_bounds(store: ResponseStore, now: list[float]) -> None:
    """A store that keeps each response for 10 s from its end, within 2,000 bytes for each
    tenant's (`now`: its clock, moved here)."""

    async def put(tenant: str, response_id: str, size: int) -> None:
        await store.put(StoredResponse(tenant, response_id, b"x" * size, now[0]))

    await put("acme", "resp_a", 100)
    found = await store.get("acme", "resp_a")
    assert found is not None and found.body == b"x" * 100 and found.ended_at == now[0]
    assert await store.get("globex", "resp_a") is None  # another tenant's
    now[0] += 11
    assert await store.get("acme", "resp_a") is None  # past its retention
    await put("acme", "resp_b", 900)
    await put("globex", "resp_g", 1_500)  # another tenant's bytes are its own
    now[0] += 1
    await put("acme", "resp_c", 900)
    now[0] += 1
    await put("acme", "resp_b", 900)  # written again (it ended again): now the newest
    assert await store.get("acme", "resp_b") is not None
    now[0] += 1
    await put("acme", "resp_d", 900)  # over 2,000 together: the oldest to end goes
    assert await store.get("acme", "resp_c") is None
    assert await store.get("acme", "resp_b") is not None
    assert await store.get("acme", "resp_d") is not None
    assert await store.get("globex", "resp_g") is not None
    await put("acme", "resp_e", 2_500)  # larger than the bound: nothing else stays
    assert await store.get("acme", "resp_b") is None and await store.get("acme", "resp_d") is None
    assert await store.get("acme", "resp_e") is None


async def test_processes_sharing_a_data_directory_share_its_responses(tmp_path: Path) -> None:
    """Two stores on one directory (two connections, as two processes have), writing at the
    same time: each waits its turn, and each finds what the other wrote."""
    stores = [SqliteResponses(tmp_path, 60, 1 << 20) for _ in range(2)]
    try:
        await asyncio.gather(
            *(
                store.put(StoredResponse("acme", f"resp_{i}_{n}", b"{}", time.time()))
                for i, store in enumerate(stores)
                for n in range(20)
            )
        )
        for store in stores:
            for i in range(2):
                assert await store.get("acme", f"resp_{i}_19") is not None
    finally:
        for store in stores:
            store.close()
