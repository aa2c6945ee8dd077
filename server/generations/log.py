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


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the log. `sse` is its SSE rendering, made once for every reader."""

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
    """

    def __init__(self, *, stream: bool) -> None:
        self.stream = stream  # a stream's error is followed by DONE; a whole response's ends it
        self.size = 0  # bytes the log holds, roughly
        self.dispatched = False
        self.concluded = False
        self.closed = False
        self.durable: int | None = None
        self._events: list[Event] = []
        self._waiters: list[asyncio.Future[None]] = []

    def __len__(self) -> int:
        return len(self._events)

    @overload
    def __getitem__(self, index: int) -> Event: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Event]: ...
    def __getitem__(self, index: int | slice) -> Event | Sequence[Event]:
        return self._events[index]

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    # -- writers ----------------------------------------------------------------------------

    def append(self, event: Event) -> None:
        self.concluded = event.kind in _LAST or (event.kind is Kind.FAILED and not self.stream)
        self._events.append(event)
        self.size += EVENT_BYTES + len(event.sse) + len(event.text)
        self.wake()

    def mark_dispatched(self) -> None:
        self.dispatched = True
        self.wake()

    def close(self) -> None:
        """Nothing more comes: readers that reach the end stop there."""
        self.closed = True
        self.wake()

    def wake(self) -> None:
        """Tell the waiters the log (or what of it readers may see) changed."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- readers ----------------------------------------------------------------------------

    async def changed(self) -> None:
        """Until the log (or what of it readers may see) grows, or it closes."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    @property
    def visible(self) -> int:
        """How many events readers may see."""
        return len(self._events) if self.durable is None else self.durable

    async def until_closed(self) -> Event:
        """The last event, once the log is closed (and readers may see all of it)."""
        while not (self.closed and self.visible == len(self._events)):
            await self.changed()
        return self._events[-1]

    async def events(self, after: int = 0) -> AsyncIterator[tuple[int, Event]]:
        """(number, event) for every event after number `after`, live, until it closes."""
        seq = after
        events = self._events
        while True:
            while seq < self.visible:
                event = events[seq]
                seq += 1
                yield seq, event
            if self.closed and seq >= len(events):
                return
            await self.changed()
