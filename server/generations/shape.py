"""What a run's output looks like (`Shape`), and the wire its log is written in, as a port
(`RunWire`): the API that owns the wire implements it (`server.chat_api.chunks.CHAT_WIRE`,
OpenAI's chunks) and the composition root hands it to the planner, so that a generation
knows no wire format.

A stream's events are rendered once each, where they are logged, for every reader that
speaks the wire (a run of the chat or completions API, or one kept to be resumed); another
API's run logs typed events alone (`Unrendered`), which its readers encode themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_adapters.protocol import OutputParser, TokenLogprob
from server.core.ids import public_id
from server.generations.choices import Choices, Echo
from server.generations.parsed import ParsedRequest


class StreamEncoder(Protocol):
    """A stream's events as bytes, one call per event. `plain`: text alone changes from one
    piece to the next (pieces of text may be merged into one)."""

    plain: bool

    def continuing(self, sent: dict[int, int]) -> None: ...

    def role(self, index: int = 0) -> bytes: ...

    def text(
        self,
        text: str,
        completion_tokens: int,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bytes: ...

    def delta(
        self,
        delta: dict[str, Any],
        completion_tokens: int,
        logprobs: Sequence[TokenLogprob] | None = None,
        index: int = 0,
        token_ids: Sequence[int] = (),
    ) -> bytes: ...

    def finish(
        self,
        finish_reason: str,
        stop_reason: Any,
        last: dict[str, Any] | None,
        completion_tokens: int,
        index: int = 0,
    ) -> bytes: ...

    def usage_chunk(self, usage_and_timings: dict[str, Any]) -> bytes: ...


class RunWire(Protocol):
    """What a run needs of the wire its log is written in, and its requests are read from."""

    done: bytes  # a stream's last event

    def encoder(
        self, shape: Shape, prompt_tokens: int, cached: Callable[[], int | None]
    ) -> StreamEncoder:
        """A stream's encoder; `cached()`: the prompt tokens the engine found cached, as far
        as it has said."""
        ...

    def whole(
        self,
        shape: Shape,
        choices: Choices,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        timings: dict[str, Any],
    ) -> dict[str, Any]:
        """A whole (not streamed) response's body, which every API's reader translates."""
        ...

    def error(self, body: dict[str, Any]) -> bytes:
        """The event of an error that ends a stream."""
        ...

    def parse(self, body: Any, kind: str) -> ParsedRequest:
        """A request body kept in the shared state, read again (a run another replica made)."""
        ...


class Unrendered:
    """A `StreamEncoder` for a run whose readers render their own wire format from the events'
    fields: each event renders no bytes."""

    def __init__(self, plain: bool) -> None:
        self.plain = plain

    def continuing(self, sent: dict[int, int]) -> None:
        pass

    def _nothing(self, *args: Any, **kwargs: Any) -> bytes:
        return b""

    role = text = delta = finish = usage_chunk = _nothing


@dataclass(frozen=True, slots=True)
class Shape:
    """What the client asked the output to look like, fixed when the run is made."""

    parsed: ParsedRequest
    model: str
    response_id: str  # its id's own part (`server.core.ids`): the id of its chunks and body
    stream: bool
    new_parser: Callable[[], OutputParser] | None = None  # one per choice
    prompt_token_ids: Sequence[int] | None = None  # with vLLM's return_token_ids
    echo: Echo | None = None  # what comes before the generated text
    first_index: int = 0  # its choice 0's index in the response (one of several prompts)
    created: int | None = None  # its chunks' `created` (None: when its encoder is made)
    stream_interval: int = 1  # tokens per chunk, but a choice's first and last (vLLM's)
    chunks: bool = True  # its stream's events carry the wire's bytes (else: none)
    wire: RunWire = field(kw_only=True)  # what its log is written in

    @property
    def public_id(self) -> str:
        return public_id(self.parsed.kind, self.response_id)

    def choices(self, *, keep: bool) -> Choices:
        return Choices(
            self.parsed.n,
            self.new_parser,
            keep=keep,
            logprobs=self.parsed.sampling.get("logprobs") is not None,
        )
