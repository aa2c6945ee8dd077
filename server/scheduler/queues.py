"""A bounded waiting room per (model, traffic class), fair across tenants.

Inside a class, tenants take turns by deficit round-robin on tokens (prompt + max_tokens): each
turn credits a tenant one quantum, and its oldest request leaves once its credit covers the
request's tokens. A tenant flooding the queue therefore gets the same token share as one
sending a trickle, and within a tenant requests leave in arrival order.
"""

from __future__ import annotations

from collections import deque

from server.scheduler.types import Ticket


class TenantFairQueue:
    def __init__(self, *, quantum_tokens: int) -> None:
        self._quantum = quantum_tokens
        self._by_tenant: dict[str, dict[str, Ticket]] = {}  # insertion-ordered per tenant
        self._turns: deque[str] = deque()  # tenants with waiting requests, in turn order
        self._deficit: dict[str, int] = {}
        self._count = 0
        self._tokens = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in waiting for waiting in self._by_tenant.values())

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def count_for(self, tenant: str) -> int:
        return len(self._by_tenant.get(tenant, ()))

    def push(self, ticket: Ticket) -> None:
        waiting = self._by_tenant.get(ticket.tenant)
        if waiting is None:
            waiting = self._by_tenant[ticket.tenant] = {}
            self._turns.append(ticket.tenant)
            self._deficit[ticket.tenant] = 0
        waiting[ticket.request_id] = ticket
        self._count += 1
        self._tokens += ticket.reserved_tokens

    def push_front(self, ticket: Ticket) -> None:
        """Put a ticket that already waited its turn first in its tenant's line, credited so
        that it leaves at its tenant's next turn (a preempted request resuming)."""
        self.push(ticket)
        waiting = self._by_tenant[ticket.tenant]
        self._by_tenant[ticket.tenant] = {
            ticket.request_id: ticket,
            **{rid: t for rid, t in waiting.items() if rid != ticket.request_id},
        }
        self._deficit[ticket.tenant] += ticket.reserved_tokens

    def remove(self, ticket: Ticket) -> bool:
        """Take a ticket out wherever it waits; False if it was not queued."""
        waiting = self._by_tenant.get(ticket.tenant)
        if waiting is None or waiting.pop(ticket.request_id, None) is None:
            return False
        self._count -= 1
        self._tokens -= ticket.reserved_tokens
        if not waiting:
            del self._by_tenant[ticket.tenant]
            del self._deficit[ticket.tenant]
            self._turns.remove(ticket.tenant)
        return True

    def peek(self) -> Ticket | None:
        """The ticket that leaves next under deficit round-robin (credits turns as it goes)."""
        turns = self._turns
        if not turns:
            return None
        while True:
            tenant = turns[0]
            head = next(iter(self._by_tenant[tenant].values()))
            cost = head.reserved_tokens
            if self._deficit[tenant] >= cost:
                return head
            if len(turns) == 1:
                # Alone: no one to be fair to; credit exactly what the head needs.
                self._deficit[tenant] = cost
                return head
            self._deficit[tenant] += self._quantum
            turns.rotate(-1)

    def pop(self, ticket: Ticket) -> None:
        """Remove `ticket`, which `peek` just returned, charging its tenant's credit."""
        self._deficit[ticket.tenant] -= ticket.reserved_tokens
        self.remove(ticket)

    def oldest_arrival(self) -> float | None:
        heads = (next(iter(waiting.values())).arrival for waiting in self._by_tenant.values())
        return min(heads, default=None)

    def tickets(self) -> list[Ticket]:
        return [t for waiting in self._by_tenant.values() for t in waiting.values()]
