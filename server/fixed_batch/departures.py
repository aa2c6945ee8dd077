"""When a batch leaves: the rule of the design problem, for one model version's queue.

With a compatible worker free, a retry group leaves at once, whole; a fresh batch leaves if it
is full, if its oldest request has waited `max_delay_s`, or at the last moment that still
meets a member's deadline. The oldest arrival is kept while every worker is busy, so an
overdue batch leaves the moment one frees up rather than waiting out a fresh timer.
"""

from __future__ import annotations

import math

from server.fixed_batch.queues import LiveRequest, ModelQueue


class Departures:
    def __init__(self, max_batch: int, max_delay_s: float) -> None:
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s

    def ready_at(self, queue: ModelQueue) -> float:
        """When the fresh batch at the head of `queue` may leave (-inf: it is full)."""
        if queue.fresh_count >= self.max_batch:
            return -math.inf
        head = queue.fresh_head()
        ready = head.ticket.arrival + self.max_delay_s if head else math.inf
        return min(ready, queue.first_latest_start())

    def next_batch(self, queue: ModelQueue, now: float) -> tuple[list[LiveRequest], bool] | None:
        """The batch that leaves now if a worker is free, and whether it is a retry; None:
        none is due. The caller dispatches it, then asks again while a worker is free."""
        while queue.groups:
            group = queue.take_group()
            if group:
                return group, True
        if queue.fresh_count and self.ready_at(queue) <= now:
            return queue.take_fresh(self.max_batch), False
        return None
