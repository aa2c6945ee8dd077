"""Fencing: every dispatch is a lease, and its id is the attempt id of each member.

Only the current attempt of a live request may complete it, so a late or stale answer (from a
batch presumed lost, or a request cancelled or retried meanwhile) is discarded, never
delivered twice. A lease not answered by its start + `timeout_s` is presumed lost with its
worker.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass

from server.fixed_batch.queues import RUNNING, LiveRequest


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    worker_id: int
    members: list[LiveRequest]
    expected_finish: float
    expires: float


def is_current(live: LiveRequest, attempt_id: int) -> bool:
    """Whether `attempt_id` is the running attempt of `live`: only it may complete `live`."""
    return live.state == RUNNING and live.attempt_id == attempt_id


class Leases:
    def __init__(self, batch_time_s: float, timeout_s: float) -> None:
        self.batch_time_s = batch_time_s
        self.timeout_s = timeout_s
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []  # heap of (expires, lease id)
        self._next_id = 0

    def grant(self, worker_id: int, members: list[LiveRequest], now: float) -> Lease:
        """A lease on `worker_id` for `members`, each now running under its id."""
        lease_id = self._next_id
        self._next_id += 1
        finish = now + self.batch_time_s
        lease = Lease(lease_id, worker_id, members, finish, now + self.timeout_s)
        self._leases[lease_id] = lease
        heapq.heappush(self._expiry, (lease.expires, lease_id))
        for live in members:
            live.state = RUNNING
            live.grouped = False
            live.attempts += 1
            live.attempt_id = lease_id
        return lease

    def end(self, lease_id: int) -> Lease | None:
        """The lease, ended (answered, or its worker lost); None if it had already ended."""
        return self._leases.pop(lease_id, None)

    def unanswered(self, lease: Lease) -> list[LiveRequest]:
        """Its members still running under it: neither answered, cancelled nor ended."""
        return [m for m in lease.members if is_current(m, lease.lease_id)]

    def due(self, now: float) -> bool:
        return bool(self._expiry) and self._expiry[0][0] <= now

    def expired(self, now: float) -> Iterator[Lease]:
        """The live leases whose time ran out by `now`, soonest first (the caller ends each)."""
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            lease = self._leases.get(heapq.heappop(expiry)[1])
            if lease is not None:
                yield lease

    def next_expiry(self) -> float:
        """When the soonest live lease runs out (inf: none)."""
        expiry = self._expiry
        while expiry and expiry[0][1] not in self._leases:
            heapq.heappop(expiry)
        return expiry[0][0] if expiry else math.inf
