"""OpenAI's Responses API on the wire: `POST /v1/responses`'s body, translated to the chat
request Sluice runs, and the response object and its stream events, built from a chat's
output as it comes (`ResponseBuilder`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
from pydantic import Field

from server.core.ids import own_part
from server.generations.usage import cached_tokens
from server.openai_wire.chat import REASONING_EFFORTS
from server.openai_wire.generation_body import (
    TEXT_ONLY,
    KvTransferParams,
    Logprobs,
    SamplingFields,
    VllmFields,
)
from server.openai_wire.items import (
    TEXT_LOGPROBS,
    InputItem,
    MessageItem,
    Metadata,
    add_call,
    chat_messages,
)
from server.openai_wire.logprobs import chat_logprobs
from server.openai_wire.wire import NoEffect, OnlyDefault, WireModel

if TYPE_CHECKING:
    from engine_adapters.protocol import TokenLogprob


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(WireModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class JsonSchemaFormat(WireModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainFormat(WireModel):
    type: Literal["text", "json_object"]


class TextConfig(WireModel):
    format: Annotated[JsonSchemaFormat | PlainFormat, Field(discriminator="type")] | None = None
    verbosity: Annotated[Any, OnlyDefault("medium")] = None


class Reasoning(WireModel):
    effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        None, description="the chat's reasoning_effort: given to the chat template"
    )
    summary: Annotated[Any, OnlyDefault("auto")] = Field(
        None, description="no summary is made (auto: the server's choice)"
    )


class ConversationRef(WireModel):
    id: str = Field(min_length=1)


class CreateResponse(SamplingFields, VllmFields):
    """`POST /v1/responses`'s body, with the sampling parameters vLLM's server takes beside
    OpenAI's (`top_k`, `seed`, `stop`, ...) and its `chat_template_kwargs`, as a chat has
    them; vLLM's other fields as docs/request-models.md says, and an undeclared field
    ignored."""

    model: str | None = None
    input: list[InputItem] | str
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: Annotated[str, Field(min_length=1)] | ConversationRef | None = Field(
        None,
        description="a conversation's id (OpenAI's Conversations API): its items come before "
        "the input, and the input and output are added to it when the response ends",
    )
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    reasoning: Reasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template (enable_thinking, ...)"
    )
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    background: bool | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    user: str | None = None
    truncation: Annotated[Any, OnlyDefault("disabled")] = None
    include: list[Annotated[str, OnlyDefault(TEXT_LOGPROBS)]] | None = None
    top_logprobs: Logprobs | None = None
    # vLLM's, as its chat has them.
    include_reasoning: bool | None = Field(None, description="vLLM's: false leaves it out")
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: one of json, regex, choice, grammar, json_object, structural_tag",
    )
    kv_transfer_params: KvTransferParams | None = None
    media_io_kwargs: Annotated[dict[str, Any] | None, NoEffect(TEXT_ONLY)] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, NoEffect(TEXT_ONLY)] = None
    request_id: Annotated[str | None, NoEffect("the response is named by Sluice")] = None
    prompt_cache_key: Annotated[str | None, NoEffect("a prefix cache hint")] = None
    max_tool_calls: Annotated[Any, OnlyDefault(None)] = None
    prompt: Annotated[Any, OnlyDefault(None, why="no stored prompt templates")] = None
    enable_response_messages: Annotated[Any, OnlyDefault(False)] = None
    previous_input_messages: Annotated[Any, OnlyDefault(None)] = None

    @property
    def logprobs(self) -> bool:
        """Whether the output text comes with its tokens' logprobs."""
        return TEXT_LOGPROBS in (self.include or ())

    @property
    def conversation_id(self) -> str | None:
        conversation = self.conversation
        return conversation.id if isinstance(conversation, ConversationRef) else conversation

    @property
    def items(self) -> list[InputItem]:
        """The input as items (a string is the user's message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return self.input

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages, without the instructions."""
        return chat_messages(self.items)

    def chat_body(self, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request that answers this one, streamed (`earlier`: the
        conversation of the previous response, if any, before this input)."""
        system = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        body: dict[str, Any] = {
            "messages": [*system, *earlier, *self.messages()],
            "stream": True,
        }
        if self.model is not None:
            body["model"] = self.model
        body.update(self.sampling_fields())
        for key, value in (
            ("max_completion_tokens", self.max_output_tokens),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("service_tier", self.service_tier),
            ("chat_template_kwargs", self.chat_template_kwargs),
            ("reasoning_effort", self.reasoning and self.reasoning.effort),
            ("include_reasoning", self.include_reasoning),
            ("structured_outputs", self.structured_outputs),
            ("cache_salt", self.cache_salt),
        ):
            if value is not None:
                body[key] = value
        if self.kv_transfer_params is not None:
            body["kv_transfer_params"] = self.kv_transfer_params.model_dump(exclude_none=True)
        if self.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if isinstance(form, JsonSchemaFormat):
            schema: dict[str, Any] = {"name": form.name, "schema": form.schema_}
            if form.description is not None:
                schema["description"] = form.description
            if form.strict is not None:
                schema["strict"] = form.strict
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif form is not None and form.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        return body

    def echoed(self) -> dict[str, Any]:
        """The request's fields the response object repeats."""
        form = self.text.format if self.text is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "conversation": None if self.conversation_id is None else {"id": self.conversation_id},
            "reasoning": {
                "effort": self.reasoning and self.reasoning.effort,
                "summary": self.reasoning and self.reasoning.summary,
            },
            "service_tier": self.service_tier or "default",
            "store": self.store is not False,
            "background": bool(self.background),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_logprobs": self.top_logprobs,
            "text": {
                "format": {"type": "text"}
                if form is None
                else form.model_dump(by_alias=True, exclude_none=True)
            },
            "tool_choice": self.tool_choice.model_dump()
            if isinstance(self.tool_choice, NamedFunction)
            else self.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or ()],
            "truncation": "disabled",
            "user": self.user,
        }


ResponseEvent = dict[str, Any]
# The response object's fields a builder makes (the rest are the request's, echoed).
_BUILT = frozenset(
    {"id", "object", "created_at", "status", "model", "output", "error", "incomplete_details"}
    | {"usage"}
)


def sse(event: ResponseEvent) -> bytes:
    """An event as the SDK reads it: its type under `event:`, itself under `data:`."""
    return b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event))


class ResponseBuilder:
    """A response object built from a chat's output as it comes, and its stream events, each
    numbered (`sequence_number` 0, 1, 2, …). Deterministic: the same output fed again gives
    the same events, so a stream can be replayed from any number."""

    def __init__(
        self, response_id: str, model: str, created_at: int, echoed: dict[str, Any]
    ) -> None:
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.echoed = echoed
        self.status = "queued" if echoed.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []  # items, the last maybe still open
        self.usage: dict[str, Any] | None = None
        self.incomplete_details: dict[str, str] | None = None
        self.error: dict[str, str] | None = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool call index → its item

    @staticmethod
    def resumed(response: dict[str, Any]) -> ResponseBuilder:
        """A builder of the response whose object, as it began, is `response` (to replay its
        events from another replica's log)."""
        echoed = {key: value for key, value in response.items() if key not in _BUILT}
        return ResponseBuilder(response["id"], response["model"], response["created_at"], echoed)

    def fresh(self) -> ResponseBuilder:
        """A builder of the same response from its beginning (to replay its events)."""
        return ResponseBuilder(self.response_id, self.model, self.created_at, self.echoed)

    @property
    def suffix(self) -> str:
        return own_part(self.response_id)

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": [_copy(item) for item in self.output],
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "usage": self.usage,
            **self.echoed,
        }

    @property
    def ended(self) -> bool:
        return self.status not in ("queued", "in_progress")

    def _event(self, type_: str, **fields: Any) -> ResponseEvent:
        event = {"type": type_, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[ResponseEvent]:
        created = self._event("response.created", response=self.snapshot())
        self.status = "in_progress"
        return [created, self._event("response.in_progress", response=self.snapshot())]

    def reasoning(self, delta: str) -> list[ResponseEvent]:
        """The model's reasoning (a reasoning parser's), as a `reasoning` item's text."""
        events: list[ResponseEvent] = []
        item = self._with_part(
            events,
            {"type": "reasoning", "id": f"rs_{self.suffix}_{len(self.output)}", "summary": []},
            {"type": "reasoning_text", "text": ""},
        )
        item["content"][0]["text"] += delta
        events.append(self._at(item, "response.reasoning_text.delta", delta=delta))
        return events

    def text(
        self, delta: str, logprobs: Sequence[TokenLogprob] | None = None
    ) -> list[ResponseEvent]:
        """Output text, and its tokens' logprobs when the request includes them."""
        events: list[ResponseEvent] = []
        item = self._with_part(
            events,
            {"type": "message", "id": f"msg_{self.suffix}_{len(self.output)}", "role": "assistant"},
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )
        part = item["content"][0]
        part["text"] += delta
        shaped = [] if logprobs is None else chat_logprobs(logprobs)
        part["logprobs"] += shaped
        events.append(self._at(item, "response.output_text.delta", delta=delta, logprobs=shaped))
        return events

    def _with_part(
        self, events: list[ResponseEvent], item: dict[str, Any], part: dict[str, Any]
    ) -> dict[str, Any]:
        """The open item if it is of `item`'s type; else `item`, opened now with its one
        content part `part` (their events added to `events`, after the last item's close)."""
        if self._open is not None and self._open["type"] == item["type"]:
            return self._open
        events += self._close()
        item = self._open = {**item, "status": "in_progress", "content": []}
        self.output.append(item)
        events.append(self._added(item))
        item["content"].append(part)
        events.append(self._part("response.content_part.added", item, part))
        return item

    def tool_calls(self, calls: list[dict[str, Any]]) -> list[ResponseEvent]:
        """Chat tool call deltas (`{index, id, function: {name, arguments}}`)."""
        events = []
        for call in calls:
            function = call.get("function") or {}
            item = self._calls.get(call.get("index", 0))
            if item is None:
                events += self._close()
                item = self._open = self._calls[call.get("index", 0)] = {
                    "type": "function_call",
                    "id": f"fc_{self.suffix}_{len(self.output)}",
                    "call_id": call.get("id") or f"call_{self.suffix}_{len(self.output)}",
                    "name": function.get("name") or "",
                    "arguments": "",
                    "status": "in_progress",
                }
                self.output.append(item)
                events.append(self._added(item))
            arguments = function.get("arguments") or ""
            if arguments:
                item["arguments"] += arguments
                events.append(
                    self._at(item, "response.function_call_arguments.delta", delta=arguments)
                )
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any]) -> list[ResponseEvent]:
        """The chat's end: its finish reason and usage (prompt, completion and cached prompt
        tokens: a chat's `usage`)."""
        events = self._close()
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": cached_tokens(usage),
                "cache_write_tokens": 0,
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
            return [*events, self._event("response.incomplete", response=self.snapshot())]
        self.status = "completed"
        return [*events, self._event("response.completed", response=self.snapshot())]

    def fail(self, error: dict[str, Any], *, cancelled: bool) -> list[ResponseEvent]:
        """The run ended without finishing: cancelled, or failed with `error` (OpenAI's error
        object)."""
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        self._open = None
        if cancelled:
            self.status = "cancelled"
            return [self._event("response.cancelled", response=self.snapshot())]
        self.status = "failed"
        self.error = {"code": error.get("code") or "server_error", "message": error["message"]}
        return [self._event("response.failed", response=self.snapshot())]

    def _close(self) -> list[ResponseEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        if item["type"] == "function_call":
            done = self._at(
                item,
                "response.function_call_arguments.done",
                name=item["name"],
                arguments=item["arguments"],
            )
            return [done, self._done(item)]
        part = item["content"][0]
        if item["type"] == "reasoning":
            return [
                self._at(item, "response.reasoning_text.done", text=part["text"]),
                self._part("response.content_part.done", item, part),
                self._done(item),
            ]
        return [
            self._at(
                item,
                "response.output_text.done",
                text=part["text"],
                logprobs=list(part["logprobs"]),
            ),
            self._part("response.content_part.done", item, part),
            self._done(item),
        ]

    def _added(self, item: dict[str, Any]) -> ResponseEvent:
        return self._event(
            "response.output_item.added",
            output_index=self.output.index(item),
            item={**item, "content": []} if "content" in item else dict(item),
        )

    def _done(self, item: dict[str, Any]) -> ResponseEvent:
        return self._event(
            "response.output_item.done", output_index=self.output.index(item), item=_copy(item)
        )

    def _part(self, type_: str, item: dict[str, Any], part: dict[str, Any]) -> ResponseEvent:
        return self._at(item, type_, part=_copy_part(part))

    def _at(self, item: dict[str, Any], type_: str, **fields: Any) -> ResponseEvent:
        where: dict[str, Any] = {"item_id": item["id"], "output_index": self.output.index(item)}
        if "content" in item:  # a message's or reasoning's one part
            where["content_index"] = 0
        return self._event(type_, **where, **fields)

    def conversation(self) -> list[dict[str, Any]]:
        """The output as chat messages, for a next request's `previous_response_id`."""
        messages: list[dict[str, Any]] = []
        for item in self.output:
            if item["type"] == "message":
                text = "".join(part["text"] for part in item["content"])
                messages.append({"role": "assistant", "content": text})
            elif item["type"] == "function_call":
                add_call(messages, item["call_id"], item["name"], item["arguments"])
        return messages


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [_copy_part(part) for part in copied["content"]]
    return copied


def _copy_part(part: dict[str, Any]) -> dict[str, Any]:
    """A part as it stands (an output text's logprobs grow in place, its text is replaced)."""
    if "logprobs" not in part:
        return dict(part)
    return {**part, "logprobs": list(part["logprobs"])}
