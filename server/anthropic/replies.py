"""Anthropic's answers: a whole `message`, the events of a streamed one, and errors.

Rendered from what a chat generation produced (its whole body's fields, its stream's text and
parsed fields), never from OpenAI's bytes. `MessageStream` keeps the content blocks' state of
one stream: a text block, a thinking block (a reasoning parser's output) or one block per tool
call, each opened, filled with deltas and closed in order.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel

from server.core.errors import SluiceError
from server.generations.usage import cached_tokens

# Anthropic's error `type` by HTTP status (Sluice's statuses are kept); any other 4xx is an
# invalid request, any other 5xx an API error.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type(error: SluiceError) -> str:
    status = error.status
    return ERROR_TYPES.get(status) or (
        "invalid_request_error" if 400 <= status < 500 else "api_error"
    )


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error object, as every error of its routes renders."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def error_body(error: SluiceError) -> dict[str, Any]:
    detail = AnthropicErrorDetail(type=error_type(error), message=error.message)
    return AnthropicErrorBody(error=detail).model_dump()


def stop_reason(finish_reason: str | None, stopped_by: Any) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for OpenAI's finish_reason and vLLM's
    stop_reason (the stop string matched, a stop token's id, or None at the end token)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as its input object ({} if they are not one)."""
    try:
        value = orjson.loads(arguments) if isinstance(arguments, str) else arguments
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """A chat's `usage` as Anthropic's: its `input_tokens` are the prompt's tokens that were
    not read from the cache (Anthropic's total input is input_tokens + cache_read_input_tokens
    + cache_creation_input_tokens); an engine's prefix cache creates no entry a client pays
    for, so cache_creation_input_tokens is 0."""
    cached = cached_tokens(chat_usage)
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": chat_usage["completion_tokens"],
    }


def message_reply(chat: dict[str, Any], message_id: str) -> dict[str, Any]:
    """A whole chat completion body (one choice) as Anthropic's `message`."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _tool_input(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    if calls and reason == "end_turn":  # a named tool's call ends with OpenAI's "stop"
        reason = "tool_use"
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat["usage"]),
    }


def event(name: str, payload: dict[str, Any]) -> bytes:
    """One SSE event as Anthropic sends them: `event: <name>` and its JSON."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


PING = event("ping", {"type": "ping"})


class MessageStream:
    """The SSE events of one streamed message, from what its generation produces."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self._index = -1  # the open (or last) content block's
        self._open: str | None = None  # its type while open
        self._tool: int | None = None  # the open tool_use block's tool call index
        self._called = False  # a tool_use block was sent
        self._text_prefix = b""

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return event("message_start", {"type": "message_start", "message": message}) + PING

    def text(self, text: str) -> bytes:
        """A piece of the answer's text."""
        if not text:
            return b""
        opened = b"" if self._open == "text" else self._begin({"type": "text", "text": ""})
        if not self._text_prefix:
            self._text_prefix = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                + str(self._index).encode()
                + b',"delta":{"type":"text_delta","text":'
            )
        return opened + self._text_prefix + orjson.dumps(text) + b"}}\n\n"

    def fields(self, fields: dict[str, Any]) -> bytes:
        """A parsed piece (a chat chunk's `delta`): reasoning, text, tool calls."""
        out = b""
        reasoning = fields.get("reasoning") or fields.get("reasoning_content")
        if reasoning:
            if self._open != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": reasoning})
        out += self.text(fields.get("content") or "")
        for call in fields.get("tool_calls") or ():
            function = call.get("function") or {}
            index = call.get("index", 0)
            if self._open != "tool_use" or index != self._tool or call.get("id"):
                out += self._begin(
                    {
                        "type": "tool_use",
                        "id": call.get("id") or f"toolu_{self.message_id}_{index}",
                        "name": function.get("name") or "",
                        "input": {},
                    }
                )
                self._tool, self._called = index, True
            arguments = function.get("arguments")
            if arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def finish(
        self, finish_reason: str | None, stopped_by: Any, chat_usage: dict[str, Any]
    ) -> bytes:
        """The open block's end, the stop reason and the usage (the whole message's, as
        Anthropic's cumulative `message_delta` usage is: `message_start`'s came before the
        engine looked the prompt up in its cache), and the message's end."""
        reason, sequence = stop_reason(finish_reason, stopped_by)
        if self._called and reason == "end_turn":
            reason = "tool_use"
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(chat_usage),
        }
        return (
            self._close()
            + event("message_delta", delta)
            + event("message_stop", {"type": "message_stop"})
        )

    def error(self, failure: SluiceError) -> bytes:
        """The error that ended the generation after the stream began."""
        return event("error", error_body(failure))

    def _begin(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        self._text_prefix = b""
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + event("content_block_start", start)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return event("content_block_delta", payload)

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = self._tool = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self._index})
