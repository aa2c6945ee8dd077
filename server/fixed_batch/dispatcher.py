"""The batch dispatcher: the functional core of batch mode.

Requests wait in one queue per model version; each worker holds one version and runs one
batch at a time. Every method takes `now` (seconds, the shell's clock) and returns decisions;
nothing here sleeps, awaits or reads a clock.

Each decision is one object's, handed its slice of the configuration; `BatchDispatcher`
composes them and moves the requests between them:

- whether a request is admitted: `admit` (`admission.py`, shared with the continuous core);
- the queue of each model version, fresh requests and retry groups: `ModelQueue` (`queues.py`);
- when a batch leaves: `Departures` (`departures.py`);
- the workers, which are free and which are down: `WorkerPool` (`workers.py`);
- fencing, each dispatch a lease whose id is its members' attempt id: `Leases` (`leases.py`);
- what a failed batch retries, and who fails: `Retries` (`retries.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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
from server.fixed_batch.departures import Departures
from server.fixed_batch.leases import Lease, Leases, is_current
from server.fixed_batch.queues import DONE, QUEUED, RUNNING, LiveRequest, ModelQueue
from server.fixed_batch.retries import Retries
from server.fixed_batch.workers import WorkerPool
from server.scheduler.types import Ticket, TrafficClass


class BatchDispatcher:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self.workers = WorkerPool(config.workers)
        self.departures = Departures(config.max_batch, config.max_delay_s)
        self.leases = Leases(config.batch_time_s, config.lease_timeout_s)
        self.retries = Retries(config.attempt_budget)
        self._queues = {model: ModelQueue(model) for model in self.workers.models}
        self._live: dict[str, LiveRequest] = {}

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
            free_at = self.workers.earliest_free(queue.model, now)
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
        live = LiveRequest(ticket, latest_start(deadline, service))
        self._live[ticket.request_id] = live
        queue.push(live)
        return None

    # --- time passing ---
    def poll(self, now: float) -> BatchStep:
        """Dispatch every batch that should leave now; expire what can no longer finish."""
        step = BatchStep()
        if self.leases.due(now):
            self._expire_leases(now, step)
        for model, queue in self._queues.items():
            if self.workers.has_free(model):
                self._dispatch_ready(queue, now, step)
            if queue.deadlines:
                self._expire_unmeetable(queue, now, step)
        return step

    def next_timer(self) -> float | None:
        """When `poll` next has something to do if nothing else happens (call after `poll`)."""
        best = self.leases.next_expiry()
        for model, queue in self._queues.items():
            if self.workers.has_free(model) and queue.fresh_count:
                best = min(best, self.departures.ready_at(queue))
        return best if best != math.inf else None

    # --- results and failures ---
    def on_result(self, request_id: str, attempt_id: int) -> Ticket | None:
        """The ticket to resolve if this is the current attempt of a live request, else None."""
        live = self._live.get(request_id)
        if live is None or not is_current(live, attempt_id):
            return None
        live.state = DONE
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
        lease = self.leases.end(lease_id)
        if lease is not None:
            for live in self.leases.unanswered(lease):  # members the worker did not answer for
                self._requeue_group([live], now, self._queues[live.ticket.model], [])
            self.workers.finished(lease.worker_id)
        return BatchCompletion(delivered, discarded, lease is not None)

    def on_worker_failure(self, worker_id: int, now: float) -> FailureOutcome:
        """The worker died (mid-batch or idle): it is down until `worker_up`."""
        lease = self.workers.lost(worker_id)
        if lease is None:
            return FailureOutcome(None, [], [])
        self.leases.end(lease.lease_id)
        ended: list[Ended] = []
        retried = self._fail_members(lease, now, ended)
        return FailureOutcome(lease.lease_id, retried, ended)

    def worker_up(self, worker_id: int) -> None:
        self.workers.restored(worker_id)

    def cancel(self, request_id: str) -> CancelStage | None:
        """Remove a queued request or fence a running one; None if it already ended."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        stage = CancelStage.RUNNING if live.state == RUNNING else CancelStage.QUEUED
        if live.state == QUEUED:
            self._queues[live.ticket.model].forget(live)
        live.state = DONE
        return stage

    # --- introspection for metrics ---
    def queue_depth(self, model: str) -> int:
        queue = self._queues.get(model)
        return queue.depth if queue else 0

    def queue_depth_by_class(self, model: str, traffic_class: TrafficClass) -> int:
        queue = self._queues.get(model)
        return queue.by_class.get(traffic_class, 0) if queue else 0

    def oldest_queued_arrival(self, model: str) -> float | None:
        queue = self._queues.get(model)
        return None if queue is None else queue.oldest_arrival()

    @property
    def models(self) -> list[str]:
        return list(self._queues)

    @property
    def live_requests(self) -> int:
        return len(self._live)

    # --- internals ---
    def _dispatch_ready(self, queue: ModelQueue, now: float, step: BatchStep) -> None:
        while self.workers.has_free(queue.model):
            batch = self.departures.next_batch(queue, now)
            if batch is None:
                return
            members, retry = batch
            worker_id = self.workers.take(queue.model)
            lease = self.leases.grant(worker_id, members, now)
            self.workers.runs(worker_id, lease)
            tickets = [live.ticket for live in members]
            step.dispatches.append(
                Dispatch(
                    worker_id,
                    lease.lease_id,
                    queue.model,
                    tickets,
                    now,
                    lease.expected_finish,
                    retry,
                )
            )

    def _expire_unmeetable(self, queue: ModelQueue, now: float, step: BatchStep) -> None:
        for live in queue.unmeetable(self.workers.earliest_free(queue.model, now)):
            self._end(live, BatchOutcome.EXPIRED, "deadline can no longer be met", step.ended)

    def _expire_leases(self, now: float, step: BatchStep) -> None:
        for lease in self.leases.expired(now):
            outcome = self.on_worker_failure(lease.worker_id, now)
            step.lost_workers.append(lease.worker_id)
            step.retried.extend(outcome.retried)
            step.ended.extend(outcome.ended)

    def _fail_members(self, lease: Lease, now: float, ended: list[Ended]) -> list[Ticket]:
        crashed = self.leases.unanswered(lease)
        groups = self.retries.regroup(crashed)
        if groups is None:
            self._end(
                crashed[0], BatchOutcome.FAILED, self.retries.culprit_reason(crashed[0]), ended
            )
            return []
        queue = self._queues[self.workers.model[lease.worker_id]]
        retried: list[Ticket] = []
        for group in groups:
            retried.extend(self._requeue_group(group, now, queue, ended))
        return retried

    def _requeue_group(
        self, group: list[LiveRequest], now: float, queue: ModelQueue, ended: list[Ended]
    ) -> list[Ticket]:
        start = self.workers.earliest_free(queue.model, now)
        kept: list[LiveRequest] = []
        for live in group:
            refusal = self.retries.refusal(live, start)
            if refusal is None:
                kept.append(live)
            else:
                self._end(live, *refusal, ended)
        if kept:
            queue.push_group(kept)
        return [live.ticket for live in kept]

    def _end(
        self, live: LiveRequest, outcome: BatchOutcome, reason: str, ended: list[Ended]
    ) -> None:
        if live.state == QUEUED:
            self._queues[live.ticket.model].forget(live)
        live.state = DONE
        self._live.pop(live.ticket.request_id, None)
        ended.append(Ended(live.ticket, outcome, reason))
