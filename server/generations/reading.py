"""How a run is read, by every API and transport: one reader's lifecycle (`reader`), and a
batch of events a reader took at once sent as few writes (`coalesced`, `sse`): consecutive
pieces of one choice's text merged into one event where the stream is plain, each event
numbered where the run can be resumed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Literal

from server.core.errors import SluiceError
from server.generations.log import Event, Kind

if TYPE_CHECKING:
    from server.generations.run import GenerationRun


@asynccontextmanager
async def reader(
    run: GenerationRun, until: Literal["dispatched", "ended"] | None = "dispatched"
) -> AsyncIterator[SluiceError | None]:
    """One reader of `run` while the block runs: counted from its entry, which awaits nothing
    first (the last reader leaving cancels the run: `GenerationRun.detach`), however the
    block ends. The block begins once the run is dispatched (`until="ended"`: once it has
    ended), and is handed the error that ended the run before its dispatch (a refusal, an
    expiry: the reply is that error), else None, and reads the log. `until=None`: at once,
    handed None (the log tells the rest)."""
    with run.reading():
        if until is None:
            yield None
            return
        await (run.started() if until == "dispatched" else run.until_ended())
        yield run.failure


def _joins(first: Event, event: Event) -> bool:
    """Whether `event` merges into a group that `first` begins: pieces of one choice's text."""
    return (
        first.kind is Kind.PIECE
        and event.kind is Kind.PIECE
        and event.index == first.index
        and not (first.local or event.local)
    )


def mergeable(run: GenerationRun) -> bool:
    """Whether pieces of its text can be sent merged, as one event: a plain stream (no
    parsed output, logprobs, token ids or usage in each chunk), rendered here."""
    shape, encoder = run.shape, run.encoder
    return (
        encoder is not None
        and encoder.plain
        and shape.new_parser is None
        and shape.parsed.sampling.get("logprobs") is None
    )


def coalesced(
    run: GenerationRun, last: int, batch: Sequence[Event], merge: bool
) -> Iterator[tuple[int, Sequence[Event]]]:
    """A batch of events a reader took at once (the last numbered `last`), as (number of
    the last, events) groups to send as one each: with `merge` (and a mergeable run),
    consecutive pieces of one choice's text form a group; every other event is alone."""
    if not (merge and len(batch) > 1 and mergeable(run)):
        for seq, event in enumerate(batch, last - len(batch) + 1):
            yield seq, (event,)
        return
    start = 0
    for end in range(1, len(batch) + 1):
        if end < len(batch) and _joins(batch[start], batch[end]):
            continue
        yield last - len(batch) + end, batch[start:end]
        start = end


def sse(run: GenerationRun, last: int, batch: Sequence[Event], merge: bool) -> bytes:
    """The SSE bytes of a batch a reader took at once: each group of `coalesced` one
    event, under its (last) number when the run is resumable. A plain stream stays as
    OpenAI's and vLLM's are, which clients that take each event for one `data:` line
    (vLLM's benchmark client among them) read."""
    numbered = run.resumable
    if len(batch) == 1 and not numbered:
        return batch[0].sse
    parts = []
    for seq, group in coalesced(run, last, batch, merge):
        event = group[0]
        if len(group) > 1:
            assert run.encoder is not None
            text = "".join(e.text for e in group)
            sse = run.encoder.text(text, 0, None, event.index)
        else:
            sse = event.sse
        # (An event of this replica's alone has no number: a client resuming elsewhere
        # names the last event of the generation it had.)
        parts.append(b"id: %d\n%s" % (seq, sse) if numbered and not event.local else sse)
    return b"".join(parts)
