"""The n choices of one generation, as the engine's deltas build them.

Every reply (a stream, a whole response, the WebSocket) reads deltas through `Choices`: which
choice each belongs to, what a chunk's `delta` holds when an output parser reads the text (tool
calls, reasoning), when each choice ends and with which finish_reason as OpenAI names it, and
that the generation ends only once every choice has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import OutputParser, PromptLogprob, TokenDelta, TokenLogprob
from server.core.errors import GenerationFailed


@dataclass(slots=True)
class Choice:
    index: int
    parser: OutputParser | None
    finish_reason: str | None = None  # the engine's, until `Choices.finish_reason` maps it
    stop_reason: Any = None
    called_tools: bool = False  # a streamed delta carried tool calls
    # What a whole response needs (kept only when `Choices(keep=True)`).
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Choices:
    """`keep`: collect each choice's text, tokens and logprobs for a whole response; else
    parse each delta for a stream as it comes."""

    def __init__(
        self, n: int, new_parser: Callable[[], OutputParser] | None, *, keep: bool, logprobs: bool
    ) -> None:
        self.n = n
        self._new_parser = new_parser
        self._keep = keep
        self._logprobs = logprobs
        self.by_index: dict[int, Choice] = {}
        self._left = n
        self.prompt_logprobs: Sequence[Sequence[PromptLogprob] | None] | None = None

    @property
    def parsed(self) -> bool:
        """Whether an output parser reads the text (else the text is the content)."""
        return self._new_parser is not None

    def add(self, delta: TokenDelta) -> tuple[Choice, dict[str, Any] | None]:
        """The delta's choice, and for a parsed stream the chunk's `delta` fields (None:
        nothing to send yet). Raises GenerationFailed if the engine aborted the choice."""
        choice = self._choice(delta.index)
        finished = delta.finish_reason is not None
        fields = None
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self._keep:
            choice.parts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            if choice.logprobs is not None and delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
        elif choice.parser is not None:
            fields = choice.parser.delta(delta.text, delta.token_ids, finished)
            choice.called_tools = choice.called_tools or bool(fields and "tool_calls" in fields)
        if finished:
            if delta.finish_reason == "abort":
                raise GenerationFailed("the engine aborted the request")
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            self._left -= 1
        return choice, fields

    def _choice(self, index: int) -> Choice:
        choice = self.by_index.get(index)
        if choice is None:
            choice = self.by_index[index] = Choice(
                index,
                None if self._new_parser is None else self._new_parser(),
                logprobs=[] if self._logprobs and self._keep else None,
            )
        return choice

    def replay(self, index: int, text: str, token_ids: Sequence[int], called_tools: bool) -> None:
        """Output another replica streamed for choice `index` before this one took the
        generation over: its parser reads it (what it would send was sent already)."""
        choice = self._choice(index)
        if choice.parser is not None:
            choice.parser.delta(text, token_ids, False)
        choice.called_tools = choice.called_tools or called_tools

    @property
    def left(self) -> int:
        """Choices not finished yet."""
        return self._left

    def check_all_finished(self) -> None:
        """At the end of the engine's stream: every choice must have finished."""
        if self._left:
            raise GenerationFailed("the engine aborted the request")

    @staticmethod
    def finish_reason(choice: Choice, called_tools: bool | None = None) -> str:
        """OpenAI's finish_reason for a finished choice ("tool_calls" where the parser says)."""
        assert choice.finish_reason is not None
        if choice.parser is None:
            return choice.finish_reason
        called = choice.called_tools if called_tools is None else called_tools
        return choice.parser.finish_reason(choice.finish_reason, called)

    def in_order(self) -> list[Choice]:
        return [self.by_index[i] for i in sorted(self.by_index)]


@dataclass(frozen=True, slots=True)
class Echo:
    """What comes first with `echo`: a completion's prompt (in its text and logprobs), or the
    assistant message a chat's answer continues (in its content). The text of the prompt's
    first token names that token in the logprobs (no logprob there: nothing precedes it);
    `prompt_only` when max_tokens was 0, so the one token generated is left out."""

    text: str
    token_ids: Sequence[int]
    first_token: str
    prompt_only: bool
