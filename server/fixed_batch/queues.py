"""The requests batch mode holds, and one queue per model version.

A request waits fresh from its arrival; after its batch failed it waits in a retry group, and
retry groups leave whole, before fresh requests. A request that leaves a queue early
(cancelled, expired) is skipped lazily where its entries lie; the counts stay exact.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from server.scheduler.types import Ticket, TrafficClass

QUEUED, RUNNING, DONE = 0, 1, 2


@dataclass(slots=True, eq=False)
class LiveRequest:
    ticket: Ticket
    latest_start: float  # the last dispatch that still meets its deadline
    state: int = QUEUED
    grouped: bool = False  # waiting in a retry group rather than the fresh queue
    attempts: int = 0
    crashes: int = 0
    attempt_id: int = -1  # its current lease's id while it runs (leases.py)


@dataclass(slots=True, eq=False)
class ModelQueue:
    model: str
    fresh: deque[LiveRequest] = field(default_factory=deque)
    fresh_count: int = 0
    groups: deque[list[LiveRequest]] = field(default_factory=deque)
    grouped_count: int = 0
    deadlines: list[tuple[float, int, LiveRequest]] = field(default_factory=list)  # heap
    by_class: dict[TrafficClass, int] = field(default_factory=dict)
    _seq: int = 0

    @property
    def depth(self) -> int:
        return self.fresh_count + self.grouped_count

    def push(self, live: LiveRequest) -> None:
        """A fresh arrival, at the back."""
        self.fresh.append(live)
        self.fresh_count += 1
        self._queued(live)

    def push_group(self, group: list[LiveRequest]) -> None:
        """Requests of a failed batch, to leave together as one retry."""
        for live in group:
            live.state = QUEUED
            live.grouped = True
            self._queued(live)
        self.groups.append(group)
        self.grouped_count += len(group)

    def take_group(self) -> list[LiveRequest]:
        """The oldest retry group's queued members (none: it emptied while it waited)."""
        group = [m for m in self.groups.popleft() if m.state == QUEUED]
        self.grouped_count -= len(group)
        self._left(group)
        return group

    def take_fresh(self, most: int) -> list[LiveRequest]:
        """Up to `most` fresh requests, oldest first."""
        take = min(most, self.fresh_count)
        members: list[LiveRequest] = []
        while len(members) < take:
            live = self.fresh.popleft()
            if live.state == QUEUED:
                members.append(live)
        self.fresh_count -= take
        self._left(members)
        return members

    def forget(self, live: LiveRequest) -> None:
        """A queued request that leaves without a batch (cancelled, expired, failed)."""
        self._count(live, -1)
        if live.grouped:
            self.grouped_count -= 1
            for group in self.groups:
                if live in group:
                    group.remove(live)
                    break
        else:
            self.fresh_count -= 1  # the entry itself is skipped lazily

    def fresh_head(self) -> LiveRequest | None:
        fresh = self.fresh
        while fresh and fresh[0].state != QUEUED:
            fresh.popleft()
        return fresh[0] if fresh else None

    def oldest_arrival(self) -> float | None:
        arrivals = [g[0].ticket.arrival for g in self.groups if g]
        head = self.fresh_head()
        if head is not None:
            arrivals.append(head.ticket.arrival)
        return min(arrivals, default=None)

    def first_latest_start(self) -> float:
        """The soonest a queued request must be dispatched to meet its deadline (inf: none)."""
        deadlines = self.deadlines
        while deadlines and deadlines[0][2].state != QUEUED:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else math.inf

    def unmeetable(self, start: float) -> Iterator[LiveRequest]:
        """The queued requests whose deadline a dispatch at `start` would miss, taken off the
        deadline heap (the caller ends them)."""
        deadlines = self.deadlines
        while deadlines and (deadlines[0][2].state != QUEUED or deadlines[0][0] < start):
            live = heapq.heappop(deadlines)[2]
            if live.state == QUEUED:
                yield live

    def _queued(self, live: LiveRequest) -> None:
        self._count(live, 1)
        if live.latest_start != math.inf:
            self._seq += 1
            heapq.heappush(self.deadlines, (live.latest_start, self._seq, live))

    def _left(self, members: list[LiveRequest]) -> None:
        for live in members:
            self._count(live, -1)

    def _count(self, live: LiveRequest, delta: int) -> None:
        key = live.ticket.traffic_class
        self.by_class[key] = self.by_class.get(key, 0) + delta
