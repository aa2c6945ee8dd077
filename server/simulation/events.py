"""A minimal discrete-event loop on a virtual clock (seconds, float).

Shells schedule callbacks at absolute virtual times; `run` pops them in time order (ties in
scheduling order) and advances `now` to each. Nothing here knows about requests or engines.

`feed` schedules one callback on each value of a time-ordered stream (a million arrivals, say)
as if each had been scheduled at once, but holds only the next one, and apart from the heap: the
heap stays as small as what is in flight, nothing is built ahead of its time, and an arrival
costs no push and pop through it (each climbs past every level). Cancelled callbacks leave the
heap when they outnumber the live ones (a simulator cancels most of its deadlines: thousands of
them would otherwise sit in the heap until their time, and every push and pop would climb past
them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class EventHandle:
    """A scheduled callback; `cancel` keeps it from running."""

    __slots__ = ("_loop", "cancelled", "time")

    def __init__(self, time: float, loop: EventLoop) -> None:
        self.time = time
        self.cancelled = False
        self._loop = loop  # the loop whose heap holds it, told of its cancellation

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._loop._cancelled_one()


# Heap entries: (time, seq, 0, callback, handle), each with a seq of its own. A feed's next item
# waits in a heap of its own, as (time, seq, index in the feed, value, callback, the feed's
# iterator): its items share the seq taken when the feed was added and count up their index, so
# they sort exactly where scheduling them all at that moment would have put them, among the
# events too (the first three keys are unique, so the rest is never compared). Nothing can
# cancel a fed item: a million arrivals build no handle.
_Entry = tuple[float, int, int, Callable[[], None], EventHandle]
_Fed = tuple[float, int, int, Any, Callable[[Any], None], Iterator[tuple[float, Any]]]


class EventLoop:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[_Entry] = []
        self._fed: list[_Fed] = []  # each feed's next item
        self._seq = itertools.count()
        self._cancelled = 0  # entries in the heap whose handle was cancelled (at most)

    def call_at(self, time: float, callback: Callable[[], None]) -> EventHandle:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        handle = EventHandle(time, self)
        heapq.heappush(self._heap, (time, next(self._seq), 0, callback, handle))
        return handle

    def call_later(self, delay: float, callback: Callable[[], None]) -> EventHandle:
        return self.call_at(self.now + delay, callback)

    def _cancelled_one(self) -> None:
        """Drop the cancelled entries once they are most of the heap (and more than a few):
        a rebuild over n entries, at most once per n/2 cancellations. Their keys are unique,
        so what is left pops in the same order."""
        self._cancelled += 1
        heap = self._heap
        if self._cancelled > 64 and 2 * self._cancelled > len(heap):
            heap[:] = [e for e in heap if not e[4].cancelled]  # in place: `run` holds the list
            heapq.heapify(heap)
            self._cancelled = 0

    def feed(self, items: Iterable[tuple[float, T]], callback: Callable[[T], None]) -> None:
        """Schedule `callback(value)` at each (time, value) of `items`, in non-decreasing time
        order, as `call_at` on each now would; the next pair is taken from `items` only when
        the previous one runs. ValueError (when it is reached) for a pair earlier than the one
        before it."""
        self._push_next(iter(items), callback, next(self._seq), 0, self.now)

    def _push_next(
        self,
        items: Iterator[tuple[float, Any]],
        callback: Callable[[Any], None],
        seq: int,
        index: int,
        after: float,
    ) -> None:
        item = next(items, None)
        if item is None:
            return
        time, value = item
        if time < after:
            raise ValueError(f"fed events out of time order: {time} < {after}")
        heapq.heappush(self._fed, (time, seq, index, value, callback, items))

    def run(self, until: float | None = None) -> None:
        """Process events in order until none remain (or the next is after `until`)."""
        heap, fed = self._heap, self._fed
        heappop = heapq.heappop
        while heap or fed:
            if fed and (not heap or fed[0] < heap[0]):  # a fed item is next
                if until is not None and fed[0][0] > until:
                    self.now = until
                    return
                time, seq, index, value, fed_callback, items = heappop(fed)
                self._push_next(items, fed_callback, seq, index + 1, time)
                self.now = time
                fed_callback(value)
                continue
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            time, _, _, callback, handle = heappop(heap)
            if handle.cancelled:
                continue
            self.now = time
            callback()
