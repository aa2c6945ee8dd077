"""OpenAI's Responses items: what `POST /v1/responses` takes as `input`, and what a conversation
of the Conversations API holds (its items ARE Responses input items, each with an id of its
own). One rendering of them into chat messages, the chat template's, serves both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, TypeAdapter

from server.core.ids import new_id
from server.openai_wire.wire import OnlyDefault, WireModel

# What `include` may ask for: the output text's logprobs (with `top_logprobs` alternatives).
TEXT_LOGPROBS = "message.output_text.logprobs"
Role = Literal["user", "assistant", "system", "developer"]
_CHAT_ROLE = {"developer": "system"}  # as chat templates know it

# OpenAI's: at most 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class TextPart(WireModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's, sent back

    def listed(self) -> dict[str, Any]:
        if self.type == "output_text":
            return {"type": self.type, "text": self.text, "annotations": self.annotations or []}
        return {"type": self.type, "text": self.text}


class MessageItem(WireModel):
    type: Literal["message"] = "message"
    role: Role
    content: str | list[TextPart]
    id: str | None = None  # an earlier output's, sent back
    status: str | None = None

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(part.text for part in content)

    def listed(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, str):
            kind: Literal["input_text", "output_text"] = (
                "output_text" if self.role == "assistant" else "input_text"
            )
            content = [TextPart(type=kind, text=content)]
        return {
            "type": "message",
            "id": new_id("message"),
            "status": "completed",
            "role": self.role,
            "content": [part.listed() for part in content],
        }


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None

    def listed(self) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": new_id("function_call"),
            "status": "completed",
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.arguments,
        }


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None

    def listed(self) -> dict[str, Any]:
        return {
            "type": "function_call_output",
            "id": new_id("function_call_output"),
            "status": "completed",
            "call_id": self.call_id,
            "output": self.output,
        }


class ReasoningText(WireModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(WireModel):
    """An earlier output's reasoning, sent back: the assistant's `reasoning` in the chat."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[Any, OnlyDefault(None)] = Field(
        None, description="not served: this server encrypts no reasoning"
    )
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        """Its reasoning (the summary's, where it has no content)."""
        return "".join(part.text for part in self.content or self.summary)

    def listed(self) -> dict[str, Any]:
        listed: dict[str, Any] = {
            "type": "reasoning",
            "id": new_id("reasoning"),
            "status": "completed",
            "summary": [part.model_dump() for part in self.summary],
        }
        if self.content is not None:
            listed["content"] = [part.model_dump() for part in self.content]
        return listed


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def read_items(listed: Sequence[dict[str, Any]]) -> list[InputItem]:
    """Items as a conversation holds them (`listed`), or as a response's output has them,
    read back as input."""
    return _ITEMS.validate_python(listed)


def chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Items as chat messages: function calls and their outputs as the assistant's tool calls
    and tool messages, reasoning as the assistant's `reasoning` in the turn with the answer or
    calls after it."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            content = item.text
            last = messages[-1] if messages else None
            if item.role == "assistant" and last is not None and thought_only(last):
                last["content"] = content  # the answer after its reasoning: one turn
            else:
                role = _CHAT_ROLE.get(item.role, item.role)
                messages.append({"role": role, "content": content})
        elif isinstance(item, ReasoningItem):
            # (both names, as vLLM's server hands them to chat templates)
            text = item.text
            messages.append(
                {"role": "assistant", "content": "", "reasoning": text, "reasoning_content": text}
            )
        elif isinstance(item, FunctionCallItem):
            add_call(messages, item.call_id, item.name, item.arguments)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def add_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    """A function call as chat messages have it: one of the assistant's `tool_calls`, in the
    assistant message just before when there is one (calls made together stay together)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and thought_only(last):
        last["tool_calls"] = [call]
    else:
        # ("" rather than null: templates that iterate the content take it, as for
        # Anthropic's tool uses in `server.anthropic.messages`)
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def thought_only(message: dict[str, Any]) -> bool:
    """An assistant's turn of reasoning alone so far (its answer or calls may follow)."""
    return (
        message["role"] == "assistant"
        and "reasoning" in message
        and not message["content"]
        and "tool_calls" not in message
    )
