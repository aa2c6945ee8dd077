"""The batch dispatcher: the functional core of batch mode.

Requests wait in one queue per model version; each worker holds one version and runs one
batch at a time. When a compatible worker is free, a batch leaves if it is full, if its oldest
request has waited `max_delay_s`, or if waiting longer would make a member miss its deadline.
The oldest arrival time is kept while workers are busy, so an overdue batch leaves the moment
a worker frees up. Every dispatch is a lease; its id is the attempt id of each member, and
only the current attempt of a live request may complete it (fencing). A failed batch is
retried whole once, then bisected until the request that crashes it is alone and failed.

Every method takes `now` (seconds, the shell's clock) and returns decisions; nothing here
sleeps, awaits or reads a clock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from server.fixed_batch.admission import RejectReason, admit, latest_start
from server.fixed_batch.decisions import (
    BatchCompletion,
    BatchConfig,
    BatchOutcome,
    BatchStep,
    CancelStage,
    Dispatch,
    Ended,
    FailureOutcome,
)
from server.scheduler.types import Ticket, TrafficClass

_QUEUED, _RUNNING, _DONE = 0, 1, 2


@dataclass(slots=True, eq=False)
class _Live:
    ticket: Ticket
    latest_start: float
    state: int = _QUEUED
    grouped: bool = False  # waiting in a retry group rather than the fresh queue
    attempts: int = 0
    crashes: int = 0
    attempt_id: int = -1


@dataclass(slots=True, eq=False)
class _Queue:
    fresh: deque[_Live] = field(default_factory=deque)
    fresh_count: int = 0
    groups: deque[list[_Live]] = field(default_factory=deque)
    grouped_count: int = 0
    deadlines: list[tuple[float, int, _Live]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # heap of free worker ids
    workers: list[int] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return self.fresh_count + self.grouped_count


@dataclass(slots=True, eq=False)
class _Lease:
    lease_id: int
    worker_id: int
    members: list[_Live]
    expected_finish: float
    expires: float


class BatchDispatcher:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self._queues: dict[str, _Queue] = {}
        self._worker_model = list(config.workers)
        self._worker_lease: list[_Lease | None] = [None] * len(config.workers)
        self._worker_up = [True] * len(config.workers)
        for worker_id, model in enumerate(config.workers):
            queue = self._queues.setdefault(model, _Queue())
            queue.workers.append(worker_id)
            heapq.heappush(queue.free, worker_id)
        self._live: dict[str, _Live] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_expiry: list[tuple[float, int]] = []
        self._next_lease = 0
        self._seq = 0
        self._depth_by_class: dict[tuple[str, TrafficClass], int] = {}

    # --- admission ---
    def submit(self, ticket: Ticket, now: float) -> RejectReason | None:
        """Queue the ticket, or return why it is refused. Call `poll` afterwards."""
        queue = self._queues.get(ticket.model)
        if ticket.request_id in self._live:
            return RejectReason.DUPLICATE_ID
        service = self.config.batch_time_s
        deadline = ticket.deadline
        if queue is None:
            free_at: float | None = None
        elif math.isfinite(deadline):
            free_at = self._earliest_free(queue, now)
        else:
            free_at = now
        reason = admit(
            now=now,
            deadline=deadline,
            queue_depth=queue.depth if queue else 0,
            queue_limit=self.config.max_queue,
            earliest_worker_free=free_at,
            service_s=service,
        )
        if reason is not None or queue is None:
            return reason
        live = _Live(ticket, latest_start(deadline, service))
        self._live[ticket.request_id] = live
        queue.fresh.append(live)
        queue.fresh_count += 1
        self._count_queued(live, 1)
        if live.latest_start != math.inf:
            self._track_deadline(queue, live)
        return None

    # --- time passing ---
    def poll(self, now: float) -> BatchStep:
        """Dispatch every batch that should leave now; expire what can no longer finish."""
        step = BatchStep()
        if self._lease_expiry and self._lease_expiry[0][0] <= now:
            self._expire_leases(now, step)
        for queue in self._queues.values():
            if queue.free:
                self._dispatch_ready(queue, now, step)
            if queue.deadlines:
                self._expire_unmeetable(queue, now, step)
        return step

    def next_timer(self) -> float | None:
        """When `poll` next has something to do if nothing else happens (call after `poll`)."""
        expiry = self._lease_expiry
        while expiry and expiry[0][1] not in self._leases:
            heapq.heappop(expiry)
        best = expiry[0][0] if expiry else math.inf
        for queue in self._queues.values():
            if queue.free and queue.fresh_count:
                best = min(best, self._ready_at(queue))
        return best if best != math.inf else None

    # --- results and failures ---
    def on_result(self, request_id: str, attempt_id: int) -> Ticket | None:
        """The ticket to resolve if this is the current attempt of a live request, else None."""
        live = self._live.get(request_id)
        if live is None or live.state != _RUNNING or live.attempt_id != attempt_id:
            return None
        live.state = _DONE
        del self._live[request_id]
        return live.ticket

    def complete_batch(
        self, lease_id: int, results: Iterable[tuple[str, int]], now: float
    ) -> BatchCompletion:
        """A worker finished lease `lease_id`; results are (request_id, attempt_id) pairs."""
        delivered: list[Ticket] = []
        discarded: list[tuple[str, int]] = []
        for request_id, attempt_id in results:
            ticket = self.on_result(request_id, attempt_id)
            if ticket is None:
                discarded.append((request_id, attempt_id))
            else:
                delivered.append(ticket)
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for live in lease.members:  # members the worker did not answer for
                if live.state == _RUNNING and live.attempt_id == lease_id:
                    self._requeue_group([live], now, self._queues[live.ticket.model], [])
            self._free_worker(lease.worker_id)
        return BatchCompletion(delivered, discarded, lease is not None)

    def on_worker_failure(self, worker_id: int, now: float) -> FailureOutcome:
        """The worker died (mid-batch or idle): it is down until `worker_up`."""
        self._worker_up[worker_id] = False
        queue = self._queues[self._worker_model[worker_id]]
        if worker_id in queue.free:
            queue.free.remove(worker_id)
            heapq.heapify(queue.free)
        lease = self._worker_lease[worker_id]
        if lease is None:
            return FailureOutcome(None, [], [])
        self._worker_lease[worker_id] = None
        del self._leases[lease.lease_id]
        ended: list[Ended] = []
        retried = self._fail_members(lease, now, ended)
        return FailureOutcome(lease.lease_id, retried, ended)

    def worker_up(self, worker_id: int) -> None:
        if self._worker_up[worker_id]:
            return
        self._worker_up[worker_id] = True
        if self._worker_lease[worker_id] is None:
            heapq.heappush(self._queues[self._worker_model[worker_id]].free, worker_id)

    def cancel(self, request_id: str) -> CancelStage | None:
        """Remove a queued request or fence a running one; None if it already ended."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        stage = CancelStage.RUNNING if live.state == _RUNNING else CancelStage.QUEUED
        if live.state == _QUEUED:
            self._forget_queued(live)
        live.state = _DONE
        return stage

    # --- introspection for metrics ---
    def queue_depth(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.depth if queue else 0

    def queue_depth_by_class(self, model: str, traffic_class: TrafficClass) -> int:
        return self._depth_by_class.get((model, traffic_class), 0)

    def oldest_queued_arrival(self, model: str) -> float | None:
        queue = self._queues.get(model)
        if queue is None:
            return None
        arrivals = [g[0].ticket.arrival for g in queue.groups if g]
        head = self._fresh_head(queue)
        if head is not None:
            arrivals.append(head.ticket.arrival)
        return min(arrivals, default=None)

    @property
    def models(self) -> list[str]:
        return list(self._queues)

    @property
    def live_requests(self) -> int:
        return len(self._live)

    # --- internals ---
    def _earliest_free(self, queue: _Queue, now: float) -> float:
        if queue.free:
            return now
        finishes = [
            lease.expected_finish
            for w in queue.workers
            if (lease := self._worker_lease[w]) is not None
        ]
        return max(now, min(finishes)) if finishes else now  # all down: assume a restart

    def _fresh_head(self, queue: _Queue) -> _Live | None:
        fresh = queue.fresh
        while fresh and fresh[0].state != _QUEUED:
            fresh.popleft()
        return fresh[0] if fresh else None

    def _ready_at(self, queue: _Queue) -> float:
        if queue.fresh_count >= self.config.max_batch:
            return -math.inf
        head = self._fresh_head(queue)
        ready = head.ticket.arrival + self.config.max_delay_s if head else math.inf
        deadlines = queue.deadlines
        while deadlines and deadlines[0][2].state != _QUEUED:
            heapq.heappop(deadlines)
        if deadlines and deadlines[0][0] < ready:
            ready = deadlines[0][0]
        return ready

    def _dispatch_ready(self, queue: _Queue, now: float, step: BatchStep) -> None:
        while queue.free and queue.groups:
            group = [m for m in queue.groups.popleft() if m.state == _QUEUED]
            queue.grouped_count -= len(group)
            if group:
                step.dispatches.append(self._dispatch(queue, group, now, retry=True))
        while queue.free and queue.fresh_count and self._ready_at(queue) <= now:
            take = min(self.config.max_batch, queue.fresh_count)
            members: list[_Live] = []
            fresh = queue.fresh
            while len(members) < take:
                live = fresh.popleft()
                if live.state == _QUEUED:
                    members.append(live)
            queue.fresh_count -= take
            step.dispatches.append(self._dispatch(queue, members, now, retry=False))

    def _dispatch(self, queue: _Queue, members: list[_Live], now: float, retry: bool) -> Dispatch:
        worker_id = heapq.heappop(queue.free)
        lease_id = self._next_lease
        self._next_lease += 1
        finish = now + self.config.batch_time_s
        lease = _Lease(lease_id, worker_id, members, finish, now + self.config.lease_timeout_s)
        self._leases[lease_id] = lease
        self._worker_lease[worker_id] = lease
        heapq.heappush(self._lease_expiry, (lease.expires, lease_id))
        for live in members:
            self._count_queued(live, -1)
            live.state = _RUNNING
            live.grouped = False
            live.attempts += 1
            live.attempt_id = lease_id
        tickets = [live.ticket for live in members]
        model = self._worker_model[worker_id]
        return Dispatch(worker_id, lease_id, model, tickets, now, finish, retry)

    def _expire_unmeetable(self, queue: _Queue, now: float, step: BatchStep) -> None:
        start = self._earliest_free(queue, now)
        deadlines = queue.deadlines
        while deadlines and (deadlines[0][2].state != _QUEUED or deadlines[0][0] < start):
            live = heapq.heappop(deadlines)[2]
            if live.state == _QUEUED:
                self._end(live, BatchOutcome.EXPIRED, "deadline can no longer be met", step.ended)

    def _expire_leases(self, now: float, step: BatchStep) -> None:
        expiry = self._lease_expiry
        while expiry and expiry[0][0] <= now:
            _, lease_id = heapq.heappop(expiry)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue
            outcome = self.on_worker_failure(lease.worker_id, now)
            step.lost_workers.append(lease.worker_id)
            step.retried.extend(outcome.retried)
            step.ended.extend(outcome.ended)

    def _fail_members(self, lease: _Lease, now: float, ended: list[Ended]) -> list[Ticket]:
        members = [
            m for m in lease.members if m.state == _RUNNING and m.attempt_id == lease.lease_id
        ]
        first_failure = all(m.crashes == 0 for m in members)
        for m in members:
            m.crashes += 1
            m.attempt_id = -1
        queue = self._queues[self._worker_model[lease.worker_id]]
        if len(members) == 1 and members[0].crashes >= 2:
            live = members[0]
            reason = f"request crashed its batch {live.crashes} times, the last time alone"
            self._end(live, BatchOutcome.FAILED, reason, ended)
            return []
        if first_failure or len(members) == 1:
            groups = [members]
        else:
            half = (len(members) + 1) // 2
            groups = [members[:half], members[half:]]
        retried: list[Ticket] = []
        for group in groups:
            retried.extend(self._requeue_group(group, now, queue, ended))
        return retried

    def _requeue_group(
        self, group: list[_Live], now: float, queue: _Queue, ended: list[Ended]
    ) -> list[Ticket]:
        start = self._earliest_free(queue, now)
        budget = self.config.attempt_budget
        kept: list[_Live] = []
        for live in group:
            if live.attempts >= budget:
                self._end(live, BatchOutcome.FAILED, f"attempt budget of {budget} exhausted", ended)
            elif live.latest_start < start:
                self._end(live, BatchOutcome.EXPIRED, "deadline cannot be met by a retry", ended)
            else:
                live.state = _QUEUED
                live.grouped = True
                self._count_queued(live, 1)
                kept.append(live)
                if live.latest_start != math.inf:
                    self._track_deadline(queue, live)
        if kept:
            queue.groups.append(kept)
            queue.grouped_count += len(kept)
        return [live.ticket for live in kept]

    def _end(self, live: _Live, outcome: BatchOutcome, reason: str, ended: list[Ended]) -> None:
        if live.state == _QUEUED:
            self._forget_queued(live)
        live.state = _DONE
        self._live.pop(live.ticket.request_id, None)
        ended.append(Ended(live.ticket, outcome, reason))

    def _forget_queued(self, live: _Live) -> None:
        self._count_queued(live, -1)
        queue = self._queues[live.ticket.model]
        if live.grouped:
            queue.grouped_count -= 1
            for group in queue.groups:
                if live in group:
                    group.remove(live)
                    break
        else:
            queue.fresh_count -= 1  # the entry itself is skipped lazily

    def _count_queued(self, live: _Live, delta: int) -> None:
        key = (live.ticket.model, live.ticket.traffic_class)
        self._depth_by_class[key] = self._depth_by_class.get(key, 0) + delta

    def _track_deadline(self, queue: _Queue, live: _Live) -> None:
        self._seq += 1
        heapq.heappush(queue.deadlines, (live.latest_start, self._seq, live))

    def _free_worker(self, worker_id: int) -> None:
        self._worker_lease[worker_id] = None
        if self._worker_up[worker_id]:
            heapq.heappush(self._queues[self._worker_model[worker_id]].free, worker_id)
