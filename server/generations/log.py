"""A generation's event log: numbered events (1, 2, 3, …) and what readers may see of them.

The run that produces a generation appends to its log; transports read the log from an
offset (`events(after)`), a whole response waits for its last event (`until_closed`). A log
written to the state replicas share (a `LogMirror`) shows its readers only what is written
there (`durable`), so whatever a client was sent can be read again on any replica.

A leaf: it knows events and waiters, nothing of the engine, the scheduler or Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, overload

from engine_adapters.protocol import TokenLogprob
from server.core.errors import SluiceError


class Kind(IntEnum):
    OPEN = 1  # a choice's first chunk (a chat's role; a completion's echoed prompt)
    PIECE = 2  # generated text, parsed fields, logprobs
    FINISH = 3  # a choice's finish_reason (the last one's carries the generation's summary)
    USAGE = 4  # the usage chunk (stream_options.include_usage)
    DONE = 5  # `[DONE]`
    FAILED = 6  # the error that ended the run (a stream's is followed by DONE)
    WHOLE = 7  # a whole response's body


_LAST = (Kind.DONE, Kind.WHOLE)
# What an event holds beside its SSE bytes and text, with the per-token costs of its run (the
# timeline's gaps): a 1,000-token stream on the sim engine measured ~580 bytes per token with
# tracemalloc, ~220 of them its SSE bytes and text.
EVENT_BYTES = 360


@dataclass(slots=True)
class Event:
    """One entry of the log. `sse` is its SSE rendering, made once for every reader. Not
    changed once made; not frozen, which would cost a microsecond per token (a frozen
    dataclass's `__init__` sets each field through `object.__setattr__`)."""

    kind: Kind
    sse: bytes = b""
    index: int = 0  # the choice
    text: str = ""
    tokens: int = 0  # generated tokens this event accounts for
    fields: dict[str, Any] | None = None  # a parsed chunk's delta (tool calls, reasoning)
    logprobs: Sequence[TokenLogprob] | None = None
    token_ids: Sequence[int] = ()
    final: dict[str, Any] | None = None  # the last FINISH: finish_reason(s), usage, timings
    body: dict[str, Any] | None = None  # WHOLE: the response
    error: SluiceError | None = None  # FAILED
    # This replica's alone, not the generation's (not in its shared log, no number): the end
    # of a stream this replica handed over to another as it stopped, or could no longer
    # follow (the shared state stopped answering).
    local: bool = False


class EventLog(Sequence[Event]):
    """The events of one generation, in order (`log[n - 1]` is event n).

    `concluded`: its last event is in (a stream's DONE; a whole response's body or error).
    `closed`: its run has ended too, and nothing more comes. `dispatched`: the generation
    reached the engine (a refusal did not). `durable`: how many events readers may see
    (None: all of them).

    A log that does not `keep` its events (a run nobody can resume, read by its one reader)
    holds only what that reader has not taken yet, and the last event it took: memory
    bounded behind the reader, whatever the generation's length. `len` still counts every
    event; indexing one dropped is an IndexError.
    """

    def __init__(self, *, stream: bool, keep: bool = True) -> None:
        self.stream = stream  # a stream's error is followed by DONE; a whole response's ends it
        self.keep = keep
        self.size = 0  # bytes the log holds, roughly (a log that keeps its events)
        self.dispatched = False
        self.concluded = False
        self.closed = False
        self.durable: int | None = None
        self._events: list[Event] = []
        self._dropped = 0  # events before the first held (a log that does not keep them)
        self._waiters: list[asyncio.Future[None]] = []
        self._closing: list[asyncio.Future[None]] = []  # woken when it closes, and only then

    def __len__(self) -> int:
        return self._dropped + len(self._events)

    @overload
    def __getitem__(self, index: int) -> Event: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Event]: ...
    def __getitem__(self, index: int | slice) -> Event | Sequence[Event]:
        if isinstance(index, slice):
            return self._events[index] if not self._dropped else list(self)[index]
        if index >= 0:
            index -= self._dropped
            if index < 0:
                raise IndexError("the event was dropped once read")
        return self._events[index]

    def __iter__(self) -> Iterator[Event]:
        if self._dropped:
            raise IndexError("the log's first events were dropped once read")
        return iter(self._events)

    @property
    def held(self) -> int:
        """How many events the log holds now."""
        return len(self._events)

    # -- writers ----------------------------------------------------------------------------

    def append(self, event: Event) -> None:
        self.concluded = event.kind in _LAST or (event.kind is Kind.FAILED and not self.stream)
        self._events.append(event)
        if self.keep:
            self.size += EVENT_BYTES + len(event.sse) + len(event.text)
        self.wake()

    def mark_dispatched(self) -> None:
        self.dispatched = True
        self.wake()

    def close(self) -> None:
        """Nothing more comes: readers that reach the end stop there."""
        self.closed = True
        self.wake()
        waiters, self._closing = self._closing, []
        _release(waiters)

    def wake(self) -> None:
        """Tell the waiters the log (or what of it readers may see) changed."""
        if self._waiters:  # (a run's own writer waits on none: nothing to allocate per event)
            waiters, self._waiters = self._waiters, []
            _release(waiters)

    # -- readers ----------------------------------------------------------------------------

    async def changed(self) -> None:
        """Until the log (or what of it readers may see) grows, or it closes."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    @property
    def visible(self) -> int:
        """How many events readers may see."""
        # (counted here rather than through `len(self)`: `take` reads it twice per event)
        return self._dropped + len(self._events) if self.durable is None else self.durable

    async def closing(self) -> None:
        """Until the log is closed (woken by that alone, not by each event)."""
        if not self.closed:
            waiter = asyncio.get_running_loop().create_future()
            self._closing.append(waiter)
            await waiter

    async def until_closed(self) -> Event:
        """The last event, once the log is closed (and readers may see all of it)."""
        while not (self.closed and self.visible == len(self)):
            await self.changed()
        return self._events[-1]

    def take(self, after: int) -> list[Event]:
        """The events after number `after` that readers may see (the last is numbered
        `self.visible`), taken by the reader that asks: a log that does not keep its events
        holds only the last of them from now on."""
        visible, dropped, events = self.visible, self._dropped, self._events
        if after >= visible:
            return []
        start = after - dropped
        if start < 0:
            raise IndexError("the events were dropped once read")
        batch = events[start : visible - dropped]
        if not self.keep:  # its one reader has them now: hold the last alone
            del events[: len(batch) + start - 1]
            self._dropped = visible - 1
        return batch

    async def batches(self, after: int = 0) -> AsyncIterator[tuple[int, list[Event]]]:
        """Every event after number `after`, live, until the log closes: at each wake, all
        that readers may see and this one has not taken, with the number of the last."""
        seq = after
        while True:
            batch = self.take(seq)
            if batch:
                seq += len(batch)
                yield seq, batch
                continue
            if self.closed and seq >= len(self):
                return
            await self.changed()

    async def events(self, after: int = 0) -> AsyncIterator[tuple[int, Event]]:
        """(number, event) for every event after number `after`, live, until it closes."""
        async for last, batch in self.batches(after):
            for seq, event in enumerate(batch, last - len(batch) + 1):
                yield seq, event


def _release(waiters: list[asyncio.Future[None]]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
