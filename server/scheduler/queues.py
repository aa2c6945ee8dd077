"""A bounded waiting room per (model, traffic class), fair across tenants and adapters.

Inside a class, each tenant's requests on each model (the base or one of its LoRA adapters)
form a line, and the lines take turns by deficit round-robin on tokens (prompt + max_tokens):
each turn credits a line one quantum, and its oldest request leaves once its credit covers the
request's tokens. A tenant flooding the queue therefore gets the same token share as one
sending a trickle, an adapter's flood the same as another adapter's, and within a line requests
leave in arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from server.scheduler.types import Ticket

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
