"""OpenAI's chat and completion wire format: stream chunks and whole responses. Built for
the per-token hot path (the Responses API's is `server.responses_api.wire`). `CHAT_WIRE` is
the port a run's log is written in (`server.generations.shape.RunWire`), which the
composition root hands to the planner.

Each stream chunk is the same JSON around a few changing values, so `ChunkEncoder` renders the
constant prefix once per request and encodes only the token text per chunk (orjson).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from engine_adapters.protocol import PromptLogprob, TokenLogprob
from server.core.ids import public_id
from server.generations.choices import Choices, Echo
from server.generations.parsed import ParsedRequest
from server.generations.shape import Shape
from server.generations.usage import usage
from server.openai_wire.logprobs import chat_logprobs
from server.openai_wire.requests import parse_request

DONE = b"data: [DONE]\n\n"


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs`; `text_offset` is where the first token's text starts.
    Each `top_logprobs` holds the sampled token and the k best, as OpenAI's does."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "text_offset": offsets,
        "token_logprobs": [e.logprob for e in entries],
        "tokens": [e.token for e in entries],
        "top_logprobs": [{e.token: e.logprob, **dict(e.top)} for e in entries],
    }


def echoed_logprobs(
    echo: Echo, positions: Sequence[Sequence[PromptLogprob] | None]
) -> dict[str, list[Any]]:
    """The prompt's part of a completion's `logprobs`, from its prompt logprobs."""
    part: dict[str, list[Any]] = {
        "text_offset": [],
        "token_logprobs": [],
        "tokens": [],
        "top_logprobs": [],
    }
    offset = 0
    for token_id, candidates in zip(echo.token_ids, positions, strict=True):
        if candidates is None:
            token, logprob, top = echo.first_token, None, None
        else:
            own = next(c for c in candidates if c.token_id == token_id)
            token, logprob = own.token, own.logprob
            # The prompt's own token first, whatever its rank, then the likeliest: vLLM's order.
            top = {own.token: own.logprob} | {c.token: c.logprob for c in candidates}
        for key, value in (
            ("text_offset", offset),
            ("token_logprobs", logprob),
            ("tokens", token),
            ("top_logprobs", top),
        ):
            part[key].append(value)
        offset += len(token)
    return part


class ChunkEncoder:
    """Renders `data: {...}\\n\\n` events for one streamed chat or text completion."""

    def __init__(
        self,
        kind: str,
        request_id: str,
        model: str,
        include_usage: bool,
        continuous_usage: bool = False,
        prompt_tokens: int = 0,
        prompt_token_ids: Sequence[int] | None = None,
        first_index: int = 0,
        created: int | None = None,
        cached: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`prompt_token_ids`: vLLM's `return_token_ids` asked for them (in the first chunk)
        and for each chunk's `token_ids`. `first_index`: the response's index of choice 0
        (a completion of several prompts numbers all their choices in one sequence).
        `cached`: the prompt tokens the engine found cached, as far as it has said, read by
        each chunk's continuous usage."""
        self.kind = kind
        self.first_index = first_index
        self.id = public_id(kind, request_id)
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.created = int(time.time()) if created is None else created
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.prompt_tokens = prompt_tokens
        self._cached = cached
        self._prompt_ids = None if prompt_token_ids is None else list(prompt_token_ids)
        self._ids = prompt_token_ids is not None
        self.plain = not (continuous_usage or self._ids)  # text alone changes per chunk
        # Characters of text sent so far, per choice (completions' text_offset).
        self._text_offset: dict[int, int] = {}
        self._completion_logprobs = False  # a completion chunk has carried logprobs
        self._head = (
            b"data: "
            + orjson.dumps(
                {"id": self.id, "object": self.object, "created": self.created, "model": model}
            )[:-1]
            + b',"choices":[{"index":'
        )
        self._prefixes = [self._prefix(0)]  # per choice index, made when first needed
        if kind == "chat":
            self._suffix = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._suffix = b',"logprobs":null,"finish_reason":null}]'
        self._suffix += b',"usage":null}\n\n' if include_usage else b"}\n\n"

    def continuing(self, sent: dict[int, int]) -> None:
        """The stream's beginning was sent by another replica: `sent` characters of text per
        choice, and the first chunk's prompt token ids."""
        self._prompt_ids = None
        self._text_offset.update(sent)

    def _prefix(self, index: int) -> bytes:
        return (
            self._head
            + str(index).encode()
            + (b',"delta":{"content":' if self.kind == "chat" else b',"text":')
        )

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model}

    def _usage(self, completion_tokens: int) -> dict[str, Any] | None:
        """A chunk's `usage`: null, or the counts so far with continuous usage (the cached
        tokens from the engine's first output on: a chat's role chunk comes before it)."""
        if not self.continuous_usage:
            return None
        return usage(self.prompt_tokens, completion_tokens, self._cached())

    def role(self, index: int = 0) -> bytes:
        """A chat choice's first chunk: the assistant role, empty content (as OpenAI sends it)."""
        choice = {
            "index": index + self.first_index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        payload = {**self._base(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = self._usage(0)
        if self._prompt_ids is not None:  # vLLM's place for them: the first chunk
            payload["prompt_token_ids"], self._prompt_ids = self._prompt_ids, None
        return self._event(payload)

    def text(
        self,
        text: str,
        completion_tokens: int,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bytes:
        """A chunk of a choice's generated text (and its tokens' logprobs when asked)."""
        if logprobs is None and self.plain:
            index += self.first_index
            while index >= len(self._prefixes):
                self._prefixes.append(self._prefix(len(self._prefixes)))
            return self._prefixes[index] + orjson.dumps(text) + self._suffix
        if self.kind == "chat":
            return self.delta({"content": text}, completion_tokens, logprobs, index, token_ids)
        # With logprobs every chunk takes this path, so the offset counts all the text.
        offset = self._text_offset.get(index, 0)
        self._text_offset[index] = offset + len(text)
        if logprobs is not None:
            self._completion_logprobs = True
        choice = {
            "index": index + self.first_index,
            "text": text,
            "logprobs": None if logprobs is None else completion_logprobs(logprobs, offset),
            "finish_reason": None,
        }
        if self._prompt_ids is not None:  # a completion's first chunk
            choice["prompt_token_ids"], self._prompt_ids = self._prompt_ids, None
        return self._chunk(choice, completion_tokens, token_ids)

    def delta(
        self,
        delta: dict[str, Any],
        completion_tokens: int,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bytes:
        """A chat chunk with `delta`'s fields (content, reasoning, tool calls)."""
        choice = {
            "index": index + self.first_index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": chat_logprobs(logprobs)},
            "finish_reason": None,
        }
        return self._chunk(choice, completion_tokens, token_ids)

    def _chunk(
        self, choice: dict[str, Any], completion_tokens: int, token_ids: Sequence[int]
    ) -> bytes:
        if self._ids:
            choice["token_ids"] = list(token_ids)
        payload = {**self._base(), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = self._usage(completion_tokens)
        return self._event(payload)

    def finish(
        self,
        finish_reason: str,
        stop_reason: Any,
        last: dict[str, Any] | None,
        completion_tokens: int,
        index: int = 0,
    ) -> bytes:
        """The chunk carrying a choice's finish_reason; `last` adds usage/timings when it ends
        the stream. As vLLM's chunks do, a completion's carries (empty) logprobs when its
        chunks carry them, and each carries (no) `token_ids` with return_token_ids: clients
        read them from every chunk."""
        index += self.first_index
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            logprobs = completion_logprobs((), 0) if self._completion_logprobs else None
            choice = {
                "index": index,
                "text": "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        choice["stop_reason"] = stop_reason
        if self._ids:
            choice["token_ids"] = []
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


def prompt_logprobs(
    positions: Sequence[Sequence[PromptLogprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, {token id: {logprob, rank,
    decoded_token}} (null at the first position)."""
    if positions is None:
        return None
    return [
        None
        if candidates is None
        else {
            str(c.token_id): {"logprob": c.logprob, "rank": c.rank, "decoded_token": c.token}
            for c in candidates
        }
        for candidates in positions
    ]


def whole_response(
    kind: str,
    request_id: str,
    model: str,
    choices: Choices,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    timings: dict[str, Any],
    prompt_token_ids: Sequence[int] | None = None,
    echo: Echo | None = None,
) -> dict[str, Any]:
    """A non-streamed chat.completion or text_completion object. A chat choice's message is
    its parser's fields (content, reasoning, tool calls), or else its text is the content.
    vLLM's `prompt_logprobs` and `prompt_token_ids` are top-level on chat, in each choice on
    completions; with `prompt_token_ids` (return_token_ids) each choice has its `token_ids`."""
    ids = None if prompt_token_ids is None else list(prompt_token_ids)
    prompt = prompt_logprobs(choices.prompt_logprobs)
    shaped = []
    for choice in choices.in_order():
        logprobs = choice.logprobs
        if kind == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": choice.text,
                "refusal": None,
                "annotations": [],
            }
            if echo is not None:
                message["content"] = echo.text + choice.text
            called = None
            if choice.parser is not None:
                message.update(choice.parser.message(choice.text, choice.token_ids))
                called = bool(message.get("tool_calls"))
                if not called:  # absent when none, as OpenAI's (and vLLM's) message has it
                    message.pop("tool_calls", None)
            shaped.append(
                {
                    "index": choice.index,
                    "message": message,
                    "logprobs": None if logprobs is None else {"content": chat_logprobs(logprobs)},
                    "finish_reason": Choices.finish_reason(choice, called),
                    "stop_reason": choice.stop_reason,
                    "token_ids": None if ids is None else choice.token_ids,
                }
            )
        else:
            text = choice.text
            shaped_logprobs = None if logprobs is None else completion_logprobs(logprobs, 0)
            if echo is not None:
                text = echo.text + ("" if echo.prompt_only else choice.text)
                if logprobs is not None:
                    assert choices.prompt_logprobs is not None
                    answer = completion_logprobs(
                        [] if echo.prompt_only else logprobs, len(echo.text)
                    )
                    shaped_logprobs = {
                        key: value + answer[key]
                        for key, value in echoed_logprobs(echo, choices.prompt_logprobs).items()
                    }
            shaped.append(
                {
                    "index": choice.index,
                    "text": text,
                    "logprobs": shaped_logprobs,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_logprobs": prompt,
                    "prompt_token_ids": ids,
                    "token_ids": None if ids is None else choice.token_ids,
                }
            )
    body: dict[str, Any] = {
        "id": public_id(kind, request_id),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": shaped,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        "timings": timings,
    }
    if kind == "chat":
        body["prompt_logprobs"] = prompt
        body["prompt_token_ids"] = ids
    return body


class ChatWire:
    """A run's log written in OpenAI's chunks, its whole body a chat.completion or
    text_completion, its requests OpenAI's (`server.generations.shape.RunWire`)."""

    done = DONE

    def encoder(
        self, shape: Shape, prompt_tokens: int, cached: Callable[[], int | None]
    ) -> ChunkEncoder:
        parsed = shape.parsed
        return ChunkEncoder(
            parsed.kind,
            shape.response_id,
            shape.model,
            parsed.include_usage,
            parsed.continuous_usage,
            prompt_tokens,
            shape.prompt_token_ids,
            shape.first_index,
            shape.created,
            cached,
        )

    def whole(
        self,
        shape: Shape,
        choices: Choices,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        timings: dict[str, Any],
    ) -> dict[str, Any]:
        return whole_response(
            shape.parsed.kind,
            shape.response_id,
            shape.model,
            choices,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            timings,
            shape.prompt_token_ids,
            shape.echo,
        )

    def error(self, body: dict[str, Any]) -> bytes:
        return ChunkEncoder.error(body)

    def parse(self, body: Any, kind: str) -> ParsedRequest:
        return parse_request(body, kind)


CHAT_WIRE = ChatWire()
