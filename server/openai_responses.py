"""OpenAI wire format: stream chunks, whole responses, usage. Built for the per-token hot path.

Each stream chunk is the same JSON around a few changing values, so `ChunkEncoder` renders the
constant prefix once per request and encodes only the token text per chunk (orjson).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import orjson

from engine_adapters.protocol import TokenLogprob

DONE = b"data: [DONE]\n\n"


def chat_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content` entries."""
    return [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in e.top]}
            for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs`; `text_offset` is where the first token's text starts.
    Each `top_logprobs` holds the sampled token and the k best, as OpenAI's does."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"text_offset": offsets, "token_logprobs": [e.logprob for e in entries],
            "tokens": [e.token for e in entries],
            "top_logprobs": [{e.token: e.logprob, **dict(e.top)} for e in entries]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ChunkEncoder:
    """Renders `data: {...}\\n\\n` events for one streamed chat or text completion."""

    def __init__(
        self, kind: str, request_id: str, model: str, include_usage: bool,
        continuous_usage: bool = False, prompt_tokens: int = 0,
    ) -> None:
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_tokens = prompt_tokens
        self._text_offset = 0  # characters of text sent so far (completions' text_offset)
        head = orjson.dumps(
            {"id": self.id, "object": self.object, "created": self.created, "model": model}
        )[:-1]
        if kind == "chat":
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._prefix = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null}]'
        self._suffix += (b',"usage":null}\n\n' if include_usage else b"}\n\n")

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int) -> dict[str, int] | None:
        """A chunk's `usage`: null, or the counts so far with continuous usage."""
        return usage(self.prompt_tokens, completion_tokens) if self.continuous_usage else None

    def role(self) -> bytes:
        """The first chat chunk: the assistant role, empty content (as OpenAI sends it)."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        payload = {**self._base(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = self._usage(0)
        return self._event(payload)

    def text(self, text: str, completion_tokens: int,
             logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """A chunk of generated text (and its tokens' logprobs when the request asked)."""
        if logprobs is None and not self.continuous_usage:
            return self._prefix + orjson.dumps(text) + self._suffix
        if self.kind == "chat":
            return self.delta({"content": text}, completion_tokens, logprobs)
        # With logprobs every chunk takes this path, so the offset counts all the text.
        offset = self._text_offset
        self._text_offset += len(text)
        choice = {"index": 0, "text": text, "logprobs": None
                  if logprobs is None else completion_logprobs(logprobs, offset),
                  "finish_reason": None}
        return self._chunk(choice, completion_tokens)

    def delta(self, delta: dict[str, Any], completion_tokens: int,
              logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """A chat chunk with `delta`'s fields (content, reasoning, tool calls)."""
        choice = {"index": 0, "delta": delta, "logprobs": None
                  if logprobs is None else {"content": chat_logprobs(logprobs)},
                  "finish_reason": None}
        return self._chunk(choice, completion_tokens)

    def _chunk(self, choice: dict[str, Any], completion_tokens: int) -> bytes:
        payload = {**self._base(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = self._usage(completion_tokens)
        return self._event(payload)

    def finish(self, finish_reason: str, stop_reason: Any, last: dict[str, Any] | None,
               completion_tokens: int) -> bytes:
        """The chunk carrying finish_reason; `last` adds usage/timings when it ends the stream."""
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        choice["stop_reason"] = stop_reason
        payload = {**self._base(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = self._usage(completion_tokens)
        if last:
            payload.update(last)
        return self._event(payload)

    def usage_chunk(self, usage_and_timings: dict[str, Any]) -> bytes:
        return self._event({**self._base(), "choices": [], **usage_and_timings})

    @staticmethod
    def error(body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"


def whole_response(
    kind: str, request_id: str, model: str, text: str, finish_reason: str | None,
    stop_reason: Any, prompt_tokens: int, completion_tokens: int, timings: dict[str, Any],
    logprobs: Sequence[TokenLogprob] | None = None, message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streamed chat.completion or text_completion object; a chat's `message` fields
    (content, reasoning, tool calls) from an output parser, else `text` is the content."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None,
                        "tool_calls": [], "annotations": [], **(message or {})},
            "logprobs": None if logprobs is None else {"content": chat_logprobs(logprobs)},
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        object_name, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None
                  if logprobs is None else completion_logprobs(logprobs, 0),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        object_name, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + request_id,
        "object": object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
        "timings": timings,
    }
