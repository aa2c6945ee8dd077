"""The wire a run's log is written in, as a port: the API that owns the wire implements it
(`server.chat_api.chunks.CHAT_WIRE`, OpenAI's chunks) and the composition root hands it to
the planner, so that a generation knows no wire format.

A stream's events are rendered once each, where they are logged, for every reader that
speaks the wire (a run of the chat or completions API, or one kept to be resumed); another
API's run logs typed events alone (`Unrendered`), which its readers encode themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from engine_adapters.protocol import TokenLogprob

if TYPE_CHECKING:
    from server.generations.assembler import Shape
    from server.generations.choices import Choices
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

    def encoder(self, shape: Shape, prompt_tokens: int, cached: Any) -> StreamEncoder:
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
