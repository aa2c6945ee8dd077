"""A stream's engine deltas as the events of its log, one delta at a time.

`StreamAssembler` is the per-delta half of a streamed run, without asyncio, a clock or a
log: each choice's output parser, the chunks of `stream_interval` tokens, tokens with nothing
to show carried by the next event, each choice's finish, and the stream's last events. It
hands each event to `emit` (the run's log; a list in tests).

Each event carries what it holds as typed fields (text, parsed fields, logprobs, token ids),
from which every API's reader renders its own wire format: Anthropic's events, the Responses
API's and Sluice's WebSocket messages. Only OpenAI's chunks are rendered here, once for every
reader (`Event.sse`), by the encoder of the wire the shape names (`RunWire`, a port the
Chat API implements), and only for a run whose readers speak it: a run of the chat or
completions API, or one kept to be resumed (any transport may come back for it by its id,
an SSE stream as well). Any other run's events carry no bytes (`Unrendered`), so each token
is encoded once, into the format its client speaks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine_adapters.protocol import TokenDelta
from server.generations.choices import Choice, Choices
from server.generations.log import Event, Kind
from server.generations.shape import Shape, StreamEncoder, Unrendered
from server.generations.usage import usage


def _filled(
    delta: TokenDelta, held: dict[int, TokenDelta], begun: set[int], interval: int
) -> TokenDelta | None:
    """`delta` with the tokens held back before it, once it fills a chunk of `interval`
    tokens (or is its choice's first or last); None: it is held back too."""
    before = held.pop(delta.index, None)
    if before is not None:
        delta = before.followed_by(delta)
    if delta.finish_reason is None and delta.index in begun and len(delta.token_ids) < interval:
        held[delta.index] = delta
        return None
    if delta.token_ids:
        begun.add(delta.index)
    return delta


class StreamAssembler:
    """The events of one streamed generation, in order: `begin` (or `resume`), `add` each
    delta, `end`. `generated` counts the tokens its events carry so far."""

    def __init__(
        self,
        shape: Shape,
        prompt_tokens: int,
        emit: Callable[[Event], None],
        cached: Callable[[], int | None] = lambda: None,
    ) -> None:
        """`cached`: the prompt tokens the engine found cached, as far as it has said (what
        continuous usage reads per chunk)."""
        parsed = shape.parsed
        self.shape = shape
        self.prompt_tokens = prompt_tokens
        self.emit = emit
        self.encoder: StreamEncoder = (
            shape.wire.encoder(shape, prompt_tokens, cached)
            if shape.chunks
            else Unrendered(not (parsed.continuous_usage or shape.prompt_token_ids is not None))
        )
        self.generated = 0
        self.choices = shape.choices(keep=False)
        self._with_ids = shape.prompt_token_ids is not None  # each chunk carries its token ids
        self._answer = shape.echo is None or not shape.echo.prompt_only  # generated text sent
        self._last: Choice | None = None  # the choice that finishes last: it ends the stream
        # Ids and text of deltas with nothing to show (the parser holds the text back), carried
        # by the next event: the log holds every token, and every character the parser read.
        self._unsent: list[int] = []
        self._unsent_text = ""
        self._held: dict[int, TokenDelta] = {}  # per choice: tokens waiting to fill a chunk
        self._begun: set[int] = set()  # choices whose first tokens were sent

    def begin(self) -> None:
        """Each choice's opening: a chat's role, the echoed text."""
        encoder, echo, emit = self.encoder, self.shape.echo, self.emit
        for index in range(self.choices.n):
            if self.shape.parsed.kind == "chat":
                emit(Event(Kind.OPEN, encoder.role(index), index))
            if echo is not None and echo.text:
                emit(Event(Kind.OPEN, encoder.text(echo.text, 0, None, index), index))

    def resume(self, events: Sequence[Event]) -> None:
        """The stream's beginning, `events`, was made on another replica: the output parsers
        read it (emitting nothing) and the counts continue from it."""
        sent: dict[int, int] = {}  # characters of text, per choice
        for event in events:
            sent[event.index] = sent.get(event.index, 0) + len(event.text)
        self.encoder.continuing(sent)
        self.generated = sum(e.tokens for e in events)
        for event in events:
            if event.kind is Kind.PIECE:
                self.choices.replay(
                    event.index,
                    event.text,
                    event.token_ids,
                    bool(event.fields and "tool_calls" in event.fields),
                )

    def add(self, delta: TokenDelta) -> int:
        """One engine delta; returns the tokens that its events carry (0: held back to fill a
        chunk of `stream_interval`)."""
        interval = self.shape.stream_interval
        if interval > 1:
            filled = _filled(delta, self._held, self._begun, interval)
            if filled is None:
                return 0
            delta = filled
        count = len(delta.token_ids)
        self.generated += count
        choices, answer = self.choices, self._answer
        choice, fields = choices.add(delta)
        shown = bool(
            fields or delta.logprobs or (self._with_ids and delta.token_ids)
            if choices.parsed
            else answer and (delta.text or delta.logprobs or (self._with_ids and delta.token_ids))
        )
        # Tokens with no text of their own ride on the next piece; a choice's last ones get a
        # piece, so that the pieces' counts add up to the tokens generated.
        shown = shown or bool(
            answer and delta.finish_reason is not None and (self._unsent or count)
        )
        if shown:
            encoder, generated = self.encoder, self.generated
            sse = (
                encoder.delta(
                    fields or {}, generated, delta.logprobs, choice.index, delta.token_ids
                )
                if choices.parsed
                else encoder.text(
                    delta.text, generated, delta.logprobs, choice.index, delta.token_ids
                )
            )
            # (With return_token_ids every delta with tokens is shown: `unsent` is empty
            # whenever the ids are rendered.)
            unsent = self._unsent
            ids = [*unsent, *delta.token_ids] if unsent else delta.token_ids
            self.emit(
                Event(
                    Kind.PIECE,
                    sse,
                    choice.index,
                    self._unsent_text + delta.text,
                    len(ids),
                    fields,
                    delta.logprobs,
                    ids,
                )
            )
            self._unsent, self._unsent_text = [], ""
        else:
            self._unsent.extend(delta.token_ids)
            self._unsent_text += delta.text
        if delta.finish_reason is not None:
            if choices.left:  # not the last to finish: its own finishing chunk now
                reason = Choices.finish_reason(choice)
                sse = self.encoder.finish(
                    reason, choice.stop_reason, None, self.generated, choice.index
                )
                self.emit(Event(Kind.FINISH, sse, choice.index))
            else:
                self._last = choice
        return count

    def end(self, timings: dict[str, Any], cached_tokens: int) -> None:
        """Every choice has finished: the last one's finishing event, which carries the
        generation's summary (`final`: its usage, with the prompt tokens the engine found
        cached, and its timings), which every API's reader renders, and the usage chunk where
        the client asked for it. Raises GenerationFailed if the engine's deltas ended before
        every choice did."""
        choices, encoder, generated = self.choices, self.encoder, self.generated
        choices.check_all_finished()
        last = self._last
        assert last is not None
        summary = {
            "usage": usage(self.prompt_tokens, generated, cached_tokens),
            "timings": timings,
        }
        ended = [(c.index, Choices.finish_reason(c)) for c in choices.in_order()]
        # (vLLM's stop_reason too: the stop string that ended choice 0, read by /v1/messages)
        final: dict[str, Any] = {
            "finish_reason": ended[0][1],
            "stop_reason": choices.in_order()[0].stop_reason,
        }
        if choices.n > 1:
            final["choices"] = [{"index": i, "finish_reason": r} for i, r in ended]
        final.update(summary)
        reason = Choices.finish_reason(last)
        if self.shape.parsed.include_usage:
            sse = encoder.finish(reason, last.stop_reason, None, generated, last.index)
            self.emit(Event(Kind.FINISH, sse, last.index, final=final))
            self.emit(Event(Kind.USAGE, encoder.usage_chunk(summary)))
        else:
            timed = {"timings": timings}
            sse = encoder.finish(reason, last.stop_reason, timed, generated, last.index)
            self.emit(Event(Kind.FINISH, sse, last.index, final=final))
