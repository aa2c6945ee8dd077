"""`POST /v1/messages` and `POST /v1/messages/count_tokens` bodies, and their translation into
the chat body Sluice runs: the system prompt becomes a system message, `tool_use` blocks the
assistant's `tool_calls`, `tool_result` blocks `tool` messages, `tools`/`tool_choice` OpenAI's.
The chat body is then validated as every chat request is, so one set of rules applies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from server.core.errors import InvalidRequest
from server.generations.parsed import ParsedRequest
from server.openai_wire.requests import parse_request
from server.openai_wire.wire import (
    UNSUPPORTED,
    NoEffect,
    Number,
    OnlyDefault,
    WireModel,
    validated,
)


class TextBlock(WireModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted, no effect")
    citations: list[dict[str, Any]] | None = Field(None, description="accepted, no effect")


class ToolUseBlock(WireModel):
    """A tool call the assistant made (earlier in the conversation)."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = Field(None, description="accepted, no effect")


class ToolResultBlock(WireModel):
    """What a tool the assistant called returned (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted, no effect")


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


_BLOCK_TYPES = ("text", "tool_use", "tool_result")


def _served_blocks(content: Any) -> Any:
    """A block of a type this server does not take (images, documents, thinking) is named
    as unsupported, before the union's alternatives each fail their own way."""
    for block in content if isinstance(content, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in _BLOCK_TYPES:
            raise PydanticCustomError(
                UNSUPPORTED,
                "'{kind}' content blocks are not supported; send text, tool_use or tool_result",
                {"kind": kind},
            )
    return content


class Message(WireModel):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[Block], BeforeValidator(_served_blocks)]


class Tool(WireModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the tool's input")
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = Field(None, description="accepted, no effect")


class ToolChoiceAuto(WireModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(WireModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(WireModel):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(WireModel):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]


class JsonOutputFormat(WireModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON Schema of the answer")


class OutputConfig(WireModel):
    """Anthropic's structured outputs (the text a JSON document of the schema, as the chat's
    `response_format` makes it) and effort (the chat's `reasoning_effort`)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Prompt(WireModel):
    """What a Messages request's prompt is made of."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat completion body with the same prompt (and tools, and output format)."""
        body: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        output = self.output_config
        if output is not None and output.format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output.format.schema_},
            }
        if output is not None and output.effort is not None:
            body["reasoning_effort"] = output.effort
        if self.tools is not None:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        **({} if tool.description is None else {"description": tool.description}),
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = _TOOL_CHOICES.get(choice.type) or {
                "type": "function",
                "function": {"name": getattr(choice, "name", "")},
            }
            if getattr(choice, "disable_parallel_tool_use", None):
                body["parallel_tool_calls"] = False
        return body

    def _chat_messages(self) -> list[dict[str, Any]]:
        system = self.system
        messages: list[dict[str, Any]] = []
        if isinstance(system, str):
            messages.append({"role": "system", "content": system})
        elif system:
            messages.append({"role": "system", "content": _parts(system)})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{i}]")
        return messages


# Anthropic's tool choice → OpenAI's (a named tool is a function choice).
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results are `tool` messages (in
    their place among its text), an assistant's tool uses its `tool_calls`."""
    role, content = message.role, message.content
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[TextBlock] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise InvalidRequest(
                    "'tool_use' blocks are the assistant's", param=f"{where}.content[{j}]"
                )
            arguments = orjson.dumps(block.input).decode()
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        else:
            if role != "user":
                raise InvalidRequest(
                    "'tool_result' blocks are the user's", param=f"{where}.content[{j}]"
                )
            if texts:  # text before the result stays before it
                out.append({"role": role, "content": _parts(texts)})
                texts = []
            result = block.content
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": result if isinstance(result, str) else _parts(result or []),
                }
            )
    if role == "assistant":
        # ("" rather than null without text: templates that iterate the content take it)
        assistant: dict[str, Any] = {"role": role, "content": _parts(texts) if texts else ""}
        if calls:
            assistant["tool_calls"] = calls
        out.append(assistant)
    elif texts or not out:
        out.append({"role": role, "content": _parts(texts)})
    return out


class MessagesRequest(_Prompt):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Annotated[dict[str, Any] | None, NoEffect("metadata (user_id)")] = None
    stream: bool | None = None
    thinking: Annotated[Any, OnlyDefault(None, why="extended thinking is not served")] = None
    # vLLM's sampling extras, as its chat completions take them.
    ignore_eos: bool | None = Field(None, description="vLLM's: generate past the end token")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description="vLLM's")
    seed: int | None = Field(None, description="vLLM's")

    def chat_body(self) -> dict[str, Any]:
        body = super().chat_body()
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.stop_sequences is not None:
            body["stop"] = self.stop_sequences
        if self.top_k == 0:  # Anthropic's 0: no limit (vLLM's -1)
            body["top_k"] = -1
        for key in ("temperature", "top_p", "top_k", "stream", "ignore_eos", "min_tokens", "seed"):
            value = getattr(self, key)
            if value is not None and key not in body:
                body[key] = value
        return body


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages body (`max_tokens` optional); only its
    prompt is read."""

    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]


def parse_messages(body: Any) -> tuple[MessagesRequest, dict[str, Any], ParsedRequest]:
    """A Messages body: validated, as the chat body it becomes, and that parsed."""
    request = validated(MessagesRequest, body)
    chat = request.chat_body()
    return request, chat, parse_request(chat, "chat")


def parse_count_tokens(body: Any) -> tuple[CountTokensRequest, dict[str, Any], ParsedRequest]:
    """A count_tokens body: validated, as the chat body with its prompt, and that parsed (1
    token to generate)."""
    request = validated(CountTokensRequest, body)
    chat = request.chat_body()
    return request, chat, parse_request({**chat, "max_tokens": 1, "stream": False}, "chat")
