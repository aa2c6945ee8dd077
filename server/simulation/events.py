"""A minimal discrete-event loop on a virtual clock (seconds, float).

Shells schedule callbacks at absolute virtual times; `run` pops them in time order (ties in
scheduling order) and advances `now` to each. Nothing here knows about requests or engines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class _Event:
    time: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class EventHandle:
    __slots__ = ("_event",)

    def __init__(self, event: _Event) -> None:
        self._event = event

    @property
    def time(self) -> float:
        return self._event.time

    def cancel(self) -> None:
        self._event.cancelled = True


class EventLoop:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[_Event] = []
        self._seq = itertools.count()

    def call_at(self, time: float, callback: Callable[[], None]) -> EventHandle:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        event = _Event(time, next(self._seq), callback)
        heapq.heappush(self._heap, event)
        return EventHandle(event)

    def call_later(self, delay: float, callback: Callable[[], None]) -> EventHandle:
        return self.call_at(self.now + delay, callback)

    def run(self, until: float | None = None) -> None:
        """Process events in order until none remain (or the next is after `until`)."""
        heap = self._heap
        while heap:
            if until is not None and heap[0].time > until:
                self.now = until
                return
            event = heapq.heappop(heap)
            if event.cancelled:
                continue
            self.now = event.time
            event.callback()
