"""A bounded waiting room per (model, traffic class), fair across tenants and adapters.

Inside a class, each tenant's requests on each model (the base or one of its LoRA adapters)
form a line, and the lines take turns by deficit round-robin on tokens (prompt + max_tokens):
each turn credits a line one quantum, and its oldest request leaves once its credit covers the
request's tokens. A tenant flooding the queue therefore gets the same token share as one
sending a trickle, an adapter's flood the same as another adapter's, and within a line requests
leave in arrival order.

`ClassQueues` holds one model's queues, one per class, with what they hold in common: the
queued tickets by id, their expected work (`backlog.py`) and their deadlines, soonest first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from server.scheduler.backlog import Backlog
from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass

Flow = tuple[str, str | None]  # (tenant, adapter)


class TenantFairQueue:
    def __init__(self, *, quantum_tokens: int) -> None:
        self._quantum = quantum_tokens
        self._by_flow: dict[Flow, dict[str, Ticket]] = {}  # insertion-ordered per line
        self._turns: deque[Flow] = deque()  # lines with waiting requests, in turn order
        self._deficit: dict[Flow, int] = {}
        self._per_tenant: dict[str, int] = {}
        self._count = 0
        self._tokens = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in waiting for waiting in self._by_flow.values())

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def count_for(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def push(self, ticket: Ticket) -> None:
        flow = ticket.flow
        waiting = self._by_flow.get(flow)
        if waiting is None:
            waiting = self._by_flow[flow] = {}
            self._turns.append(flow)
            self._deficit[flow] = 0
        waiting[ticket.request_id] = ticket
        self._per_tenant[ticket.tenant] = self._per_tenant.get(ticket.tenant, 0) + 1
        self._count += 1
        self._tokens += ticket.reserved_tokens

    def push_front(self, ticket: Ticket) -> None:
        """Put a ticket that already waited its turn first in its line, credited so that it
        leaves at its line's next turn (a preempted request resuming)."""
        self.push(ticket)
        flow = ticket.flow
        waiting = self._by_flow[flow]
        self._by_flow[flow] = {
            ticket.request_id: ticket,
            **{rid: t for rid, t in waiting.items() if rid != ticket.request_id},
        }
        self._deficit[flow] += ticket.reserved_tokens

    def remove(self, ticket: Ticket) -> bool:
        """Take a ticket out wherever it waits; False if it was not queued."""
        flow = ticket.flow
        waiting = self._by_flow.get(flow)
        if waiting is None or waiting.pop(ticket.request_id, None) is None:
            return False
        self._count -= 1
        self._tokens -= ticket.reserved_tokens
        left = self._per_tenant[ticket.tenant] - 1
        if left:
            self._per_tenant[ticket.tenant] = left
        else:
            del self._per_tenant[ticket.tenant]
        if not waiting:
            del self._by_flow[flow]
            del self._deficit[flow]
            self._turns.remove(flow)
        return True

    def peek(self) -> Ticket | None:
        """The ticket that leaves next under deficit round-robin (credits turns as it goes)."""
        turns = self._turns
        if not turns:
            return None
        while True:
            flow = turns[0]
            head = next(iter(self._by_flow[flow].values()))
            cost = head.reserved_tokens
            if self._deficit[flow] >= cost:
                return head
            if len(turns) == 1:
                # Alone: no one to be fair to; credit exactly what the head needs.
                self._deficit[flow] = cost
                return head
            self._deficit[flow] += self._quantum
            turns.rotate(-1)

    def first(self, may_start: Callable[[Ticket], bool]) -> Ticket | None:
        """The first head, in turn order from the line whose turn it is, that `may_start`
        (crediting nothing: popped, it is charged to its line as any other, which then waits
        its turns to pay it back)."""
        for flow in self._turns:
            head = next(iter(self._by_flow[flow].values()))
            if may_start(head):
                return head
        return None

    def pop(self, ticket: Ticket) -> None:
        """Remove `ticket`, which `peek` just returned, charging its line's credit."""
        self._deficit[ticket.flow] -= ticket.reserved_tokens
        self.remove(ticket)

    def oldest_arrival(self) -> float | None:
        heads = (next(iter(waiting.values())).arrival for waiting in self._by_flow.values())
        return min(heads, default=None)

    def tickets(self) -> list[Ticket]:
        return [t for waiting in self._by_flow.values() for t in waiting.values()]


class ClassQueues:
    """Where admitted tickets wait for their dispatch: interactive's queue and bulk's."""

    def __init__(self, *, quantum_tokens: int) -> None:
        self.by_class = {c: TenantFairQueue(quantum_tokens=quantum_tokens) for c in TrafficClass}
        self.interactive = self.by_class[INTERACTIVE]
        self.bulk = self.by_class[BULK]
        self.backlog = Backlog()  # the queued tickets' expected work
        self._queued: dict[str, Ticket] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, order, request id)
        self._order = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def __len__(self) -> int:
        return len(self._queued)

    def get(self, request_id: str) -> Ticket | None:
        return self._queued.get(request_id)

    def add(self, ticket: Ticket, expected_output: float, *, front: bool = False) -> None:
        """Queue `ticket`, expected to generate `expected_output` tokens; `front`: a preempted
        bulk ticket's continuation, first in its line."""
        if front:
            self.bulk.push_front(ticket)
        else:
            self.by_class[ticket.traffic_class].push(ticket)
        self._queued[ticket.request_id] = ticket
        self.backlog.add(ticket, expected_output)
        heapq.heappush(self._deadlines, (ticket.deadline, next(self._order), ticket.request_id))

    def remove(self, ticket: Ticket) -> None:
        """Take a queued ticket out (cancelled, or expired)."""
        del self._queued[ticket.request_id]
        self.by_class[ticket.traffic_class].remove(ticket)
        self.backlog.remove(ticket)

    def start(self, ticket: Ticket) -> float:
        """Take out `ticket`, which its queue's `peek` or `first` just returned, for dispatch;
        returns the output tokens it was expected to generate."""
        self.by_class[ticket.traffic_class].pop(ticket)
        del self._queued[ticket.request_id]
        return self.backlog.remove(ticket)

    def expire(self, now: float) -> list[Ticket]:
        """Take out the queued tickets whose deadline is `now` or earlier, soonest first."""
        expired: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, request_id = heapq.heappop(heap)
            ticket = self._queued.get(request_id)
            if ticket is not None:
                self.remove(ticket)
                expired.append(ticket)
        return expired

    def next_deadline(self) -> float | None:
        """The soonest deadline of a ticket still queued."""
        heap = self._deadlines
        while heap and heap[0][2] not in self._queued:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def oldest_age(self, traffic_class: TrafficClass, now: float) -> float:
        oldest = self.by_class[traffic_class].oldest_arrival()
        return 0.0 if oldest is None else max(0.0, now - oldest)
