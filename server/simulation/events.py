"""A minimal discrete-event loop on a virtual clock (seconds, float).

Shells schedule callbacks at absolute virtual times; `run` pops them in time order (ties in
scheduling order) and advances `now` to each. Nothing here knows about requests or engines.

`feed` schedules a time-ordered stream of callbacks (a million arrivals, say) as if each had
been scheduled at once, but holds only the next one: the heap stays as small as what is in
flight, and nothing is built ahead of its time. Cancelled callbacks leave the heap when they
outnumber the live ones (a simulator cancels most of its deadlines: thousands of them would
otherwise sit in the heap until their time, and every push and pop would climb past them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator


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


_Feed = Iterator[tuple[float, Callable[[], None]]]

# Heap entries: (time, seq, index in its feed, callback, handle, feed). A plain event has its own
# seq, index 0, its handle and no feed; a feed's items share the seq taken when it was added and
# count up their index, so they sort exactly where scheduling them all at that moment would have
# put them, and carry their feed, to take the next item from, and no handle (nothing can cancel
# them: a million arrivals build none). The three keys are unique, so the rest is never compared.
_Entry = tuple[float, int, int, Callable[[], None], EventHandle | None, _Feed | None]


class EventLoop:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._cancelled = 0  # entries in the heap whose handle was cancelled (at most)

    def call_at(self, time: float, callback: Callable[[], None]) -> EventHandle:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        handle = EventHandle(time, self)
        heapq.heappush(self._heap, (time, next(self._seq), 0, callback, handle, None))
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
            heap[:] = [e for e in heap if e[4] is None or not e[4].cancelled]  # in place: `run`
            heapq.heapify(heap)  # holds the list
            self._cancelled = 0

    def feed(self, items: Iterable[tuple[float, Callable[[], None]]]) -> None:
        """Schedule (time, callback) pairs, in non-decreasing time order, as `call_at` on each
        now would; the next pair is taken from `items` only when the previous one runs.
        ValueError (when it is reached) for a pair earlier than the one before it."""
        self._push_next(iter(items), next(self._seq), 0, self.now)

    def _push_next(self, items: _Feed, seq: int, index: int, after: float) -> None:
        item = next(items, None)
        if item is None:
            return
        time, callback = item
        if time < after:
            raise ValueError(f"fed events out of time order: {time} < {after}")
        heapq.heappush(self._heap, (time, seq, index, callback, None, items))

    def run(self, until: float | None = None) -> None:
        """Process events in order until none remain (or the next is after `until`)."""
        heap = self._heap
        heappop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            time, seq, index, callback, handle, feed = heappop(heap)
            if feed is not None:
                self._push_next(feed, seq, index + 1, time)
            elif handle is not None and handle.cancelled:
                continue
            self.now = time
            callback()
