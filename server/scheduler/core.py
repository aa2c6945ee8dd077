"""The scheduler's decisions, as a plain class: every method takes `now` and returns values.

No asyncio, no sockets, no wall clock: the asyncio runtime (`runtime.py`) and the simulator
(`server/simulation/continuous.py`) drive the same `SchedulerCore`. One core serves one model.

Life of a ticket: `submit` admits it (queued) or rejects it with a reason; `dispatchable` moves
queued tickets that fit the budgets to running (interactive first, bulk within its share, DRR
across tenants); `expire` removes queued tickets whose deadline has passed; `release` ends a
ticket wherever it is (queued: cancelled; running: finished, aborted or expired) and gives its
budgets back. Ending an unknown or already-ended ticket is a no-op, so a late output never
revives an expired request. While a ticket runs, the shell reports each output's tokens to
`generated`: the core's count of what it produced, and the rate estimates' input.

Preemption: when the interactive head has waited `preempt_bulk_after_s` and no budget has room
for it, `preemptions` names running bulk tickets to stop (the most recently dispatched first,
just enough for the head, never below bulk's minimum share). The shell aborts their engine
requests and calls `requeue`; the ticket returns to the front of its
tenant's bulk line as a continuation (prompt plus generated tokens, the rest of max_tokens),
keeping its arrival and deadline.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, replace
from typing import Literal

from server.config import SluiceConfig
from server.errors import (
    DeadlineUnmeetable,
    InvalidRequest,
    Overloaded,
    SluiceError,
    TenantQuotaExceeded,
)
from server.scheduler.backlog import Backlog
from server.scheduler.budgets import BudgetLedger, BudgetLimits
from server.scheduler.estimates import RateEstimates
from server.scheduler.queues import TenantFairQueue
from server.scheduler.quotas import TenantQuotas
from server.scheduler.types import Ticket, TrafficClass

RejectReason = Literal[
    "overloaded", "tenant_quota_exceeded", "deadline_unmeetable", "request_too_large"
]
Stage = Literal["queued", "running"]

_ERRORS: dict[str, type[SluiceError]] = {
    "overloaded": Overloaded,
    "tenant_quota_exceeded": TenantQuotaExceeded,
    "deadline_unmeetable": DeadlineUnmeetable,
    "request_too_large": InvalidRequest,
}


@dataclass(frozen=True, slots=True)
class Admitted:
    ticket: Ticket
    predicted_start: float


@dataclass(frozen=True, slots=True)
class Rejected:
    ticket: Ticket
    reason: RejectReason
    message: str
    retry_after: float | None = None

    def to_error(self) -> SluiceError:
        return _ERRORS[self.reason](self.message, retry_after=self.retry_after)


@dataclass(slots=True)
class _Running:
    ticket: Ticket
    dispatched_at: float
    expected_output: float  # tokens it is expected to generate in this dispatch
    generated: int = 0  # tokens it generated in this dispatch, as the shell reported them
    first_token_at: float | None = None
    preempting: bool = False


class SchedulerCore:
    def __init__(self, config: SluiceConfig, limits: BudgetLimits) -> None:
        self.config = config
        self.ledger = BudgetLedger(limits, config.budgets)
        self.estimates = RateEstimates(config.estimates)
        quantum = config.budgets.fairness_quantum_tokens
        self._queues = {c: TenantFairQueue(quantum_tokens=quantum) for c in TrafficClass}
        self._queued: dict[str, Ticket] = {}
        self._backlog = Backlog()  # the queued tickets' expected work
        self._running: dict[str, _Running] = {}
        self._running_output_left = 0.0  # expected output tokens minus generated, of running
        self._running_per_class = dict.fromkeys(TrafficClass, 0)
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._quotas = TenantQuotas(config.tenants)
        self._expired_outbox: list[Ticket] = []
        self._mean_reserved = 1024.0
        self._many_tenants = len(config.tenants) > 1
        self._preempt_considered: str | None = None  # head already judged past its threshold
        self.preemptions_total = 0

    # --- admission ---------------------------------------------------------------------
    def submit(self, ticket: Ticket, now: float) -> Admitted | Rejected:
        if ticket.request_id in self._queued or ticket.request_id in self._running:
            raise ValueError(f"duplicate request id {ticket.request_id!r}")
        tc = ticket.traffic_class
        if not self.ledger.ever_fits(ticket):
            return Rejected(ticket, "request_too_large", (
                f"the request reserves {ticket.reserved_tokens} tokens (prompt + max_tokens), "
                f"more than the {tc} budget allows; lower max_tokens"
            ))
        refusal = self._check_tenant(ticket, now)
        if refusal is not None:
            return refusal
        class_config = self.config.classes[tc]
        queue = self._queues[tc]
        if (
            len(queue) >= class_config.max_queued
            or queue.queued_tokens + ticket.reserved_tokens > class_config.max_queued_tokens
        ):
            drain = self.predicted_wait(ticket, now)
            return Rejected(ticket, "overloaded", f"the {tc} queue is full; retry later",
                            retry_after=max(1.0, drain))
        wait = self.predicted_wait(ticket, now)
        # It runs among as many sequences as run now, or, if it must queue, as many as fit.
        concurrency = (len(self._running) + 1 if wait == 0.0
                       else self._concurrency(ticket.traffic_class))
        predicted_start = now + wait
        predicted_end = predicted_start + self.estimates.service_seconds(ticket, concurrency)
        margin = self.config.estimates.admission_margin * (predicted_end - now)
        if predicted_end + margin > ticket.deadline:
            return Rejected(ticket, "deadline_unmeetable", (
                f"predicted completion in {predicted_end - now:.3f}s (plus a "
                f"{self.config.estimates.admission_margin:.0%} margin) exceeds the deadline "
                f"in {max(0.0, ticket.deadline - now):.3f}s"
            ), retry_after=max(1.0, predicted_start - now))
        self._admit(ticket, now)
        return Admitted(ticket, predicted_start)

    def _check_tenant(self, ticket: Ticket, now: float) -> Rejected | None:
        quota = self._quotas.check(ticket, now)
        if quota is not None:
            return Rejected(ticket, "tenant_quota_exceeded", quota.message,
                            retry_after=quota.retry_after)
        class_config = self.config.classes[ticket.traffic_class]
        if self._many_tenants:
            share = max(1, math.ceil(class_config.max_queued * class_config.tenant_queue_share))
            if self._queues[ticket.traffic_class].count_for(ticket.tenant) >= share:
                return Rejected(ticket, "tenant_quota_exceeded",
                                f"tenant {ticket.tenant!r} holds its share of the "
                                f"{ticket.traffic_class} queue ({share})", retry_after=1.0)
        return None

    def _admit(self, ticket: Ticket, now: float) -> None:
        tc = ticket.traffic_class
        self._queues[tc].push(ticket)
        self._queued[ticket.request_id] = ticket
        self._backlog.add(ticket, self.estimates.expected_output_tokens(ticket))
        heapq.heappush(self._deadlines, (ticket.deadline, next(self._seq), ticket.request_id))
        self._quotas.admitted(ticket, now)
        self._mean_reserved += 0.05 * (ticket.reserved_tokens - self._mean_reserved)

    # --- predictions -------------------------------------------------------------------
    def _concurrency(self, traffic_class: TrafficClass) -> float:
        tokens_cap, _, seqs_cap = self.ledger.class_cap(traffic_class)
        return max(1.0, min(float(seqs_cap), tokens_cap / max(1.0, self._mean_reserved)))

    def predicted_wait(self, ticket: Ticket, now: float, *, fair: bool = True) -> float:
        """Expected seconds from now until `ticket` (not yet queued) would be dispatched: the
        work running and queued ahead of it (its tenant's fair share of the queue, or with
        `fair=False` all of it), drained by the engine at full concurrency."""
        tc = ticket.traffic_class
        queued_ahead = len(self._queues[TrafficClass.INTERACTIVE])
        if tc is TrafficClass.BULK:
            queued_ahead += len(self._queues[TrafficClass.BULK])
        if queued_ahead == 0 and self.ledger.fits(ticket, bulk_waiting=False):
            return 0.0
        concurrency = self._concurrency(tc)
        step = self.estimates.steps.at(concurrency)
        prefill_rate = self.estimates.prefill_tokens_per_s

        def seconds(prompt_tokens: float, output_tokens: float) -> float:
            return prompt_tokens / prefill_rate + output_tokens * step

        own = self.estimates.service_seconds(ticket, concurrency)
        ahead = self._backlog.seconds_ahead(tc, ticket.tenant if fair else None, own, seconds)
        ahead += max(0.0, self._running_output_left) * step
        return ahead / concurrency

    def pressure(self, traffic_class: TrafficClass, now: float) -> float:
        """Predicted queue wait for a typical new request over the class's deadline budget."""
        probe = Ticket("", "", traffic_class, "", now, now, int(self._mean_reserved) // 2,
                       int(self._mean_reserved) - int(self._mean_reserved) // 2)
        wait = self.predicted_wait(probe, now, fair=False)
        return wait / self.config.classes[traffic_class].deadline_s

    # --- dispatch and expiry -----------------------------------------------------------
    def dispatchable(self, now: float) -> list[Ticket]:
        """Queued tickets to start now, in order; they hold their budgets from here on."""
        self._expired_outbox.extend(self._expire_due(now))
        interactive = self._queues[TrafficClass.INTERACTIVE]
        bulk = self._queues[TrafficClass.BULK]
        started: list[Ticket] = []
        while True:
            head = interactive.peek()
            if head is not None and self.ledger.fits(head, bulk_waiting=len(bulk) > 0):
                interactive.pop(head)
                started.append(self._start(head, now))
                continue
            bulk_head = bulk.peek()
            if bulk_head is not None and (
                self.ledger.fits(bulk_head, bulk_waiting=True)
                if head is None
                else self.ledger.fits_bulk_floor(bulk_head)
            ):
                bulk.pop(bulk_head)
                started.append(self._start(bulk_head, now))
                continue
            return started

    def _start(self, ticket: Ticket, now: float) -> Ticket:
        del self._queued[ticket.request_id]
        expected_output = self._backlog.remove(ticket)
        self.ledger.acquire(ticket)
        self._running[ticket.request_id] = _Running(ticket, now, expected_output)
        self._running_output_left += expected_output
        self._running_per_class[ticket.traffic_class] += 1
        self.estimates.running_changed(len(self._running), now)
        return ticket

    def _expire_due(self, now: float) -> list[Ticket]:
        expired: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, request_id = heapq.heappop(heap)
            ticket = self._queued.get(request_id)
            if ticket is not None:
                self._remove_queued(ticket)
                expired.append(ticket)
        return expired

    def expire(self, now: float) -> list[Ticket]:
        """Queued tickets whose deadline has passed, removed from the queue."""
        expired, self._expired_outbox = self._expired_outbox, []
        expired.extend(self._expire_due(now))
        return expired

    def next_wakeup(self) -> float | None:
        """When the shell should call in next: the earliest deadline of a queued ticket, or
        the moment the interactive head may preempt bulk, whichever comes first."""
        heap = self._deadlines
        while heap and heap[0][2] not in self._queued:
            heapq.heappop(heap)
        wake = heap[0][0] if heap else None
        preempt_at = self._preempt_time()
        if preempt_at is not None and (wake is None or preempt_at < wake):
            return preempt_at
        return wake

    def _preempt_time(self) -> float | None:
        after = self.config.budgets.preempt_bulk_after_s
        if after is None or self._running_per_class[TrafficClass.BULK] == 0:
            return None
        head = self._queues[TrafficClass.INTERACTIVE].peek()
        if head is None or head.request_id == self._preempt_considered:
            return None
        return head.arrival + after

    # --- preemption --------------------------------------------------------------------
    def preemptions(self, now: float) -> list[Ticket]:
        """Running bulk tickets to stop now so the waiting interactive head can start.

        Returns [] unless the head has waited its threshold, does not fit, and stopping bulk
        (down to bulk's minimum share) makes it fit. Each ticket is named once; it keeps its
        budgets until the shell calls `requeue` (or `release`, if it ended meanwhile).
        """
        preempt_at = self._preempt_time()
        if preempt_at is None or now < preempt_at:
            return []
        head = self._queues[TrafficClass.INTERACTIVE].peek()
        assert head is not None
        self._preempt_considered = head.request_id
        leaving = [e.ticket for e in self._running.values() if e.preempting]
        if self.ledger.fits(head, bulk_waiting=True, freeing=leaving):
            return []  # what is already being stopped makes room
        candidates = sorted(
            (e for e in self._running.values()
             if e.ticket.traffic_class is TrafficClass.BULK and not e.preempting),
            key=lambda e: e.dispatched_at, reverse=True,
        )
        chosen: list[_Running] = []
        for entry in candidates:
            chosen.append(entry)
            if self.ledger.fits(head, bulk_waiting=True,
                                freeing=leaving + [e.ticket for e in chosen]):
                break
        else:
            return []  # even stopping every bulk request would not make room
        for entry in chosen:
            entry.preempting = True
        return [entry.ticket for entry in chosen]

    def requeue(self, request_id: str, now: float) -> Ticket | None:
        """Put a preempted running ticket back in the bulk queue as a continuation of what it
        generated in this dispatch (as `generated` reported it).

        Returns the continuation ticket; None if the ticket had already ended. Its budgets are
        free from here on.
        """
        entry = self._running.get(request_id)
        if entry is None:
            return None
        ticket = entry.ticket
        generated_tokens = entry.generated
        if generated_tokens >= ticket.max_tokens:
            raise ValueError(
                f"{request_id!r}: {generated_tokens} generated of {ticket.max_tokens}; "
                "a request with nothing left to generate is finished, not requeued")
        self._leave_running(entry, now)
        continuation = replace(
            ticket,
            prompt_tokens=ticket.prompt_tokens + generated_tokens,
            max_tokens=ticket.max_tokens - generated_tokens,
        )
        self._queues[TrafficClass.BULK].push_front(continuation)
        self._queued[request_id] = continuation
        self._backlog.add(continuation, self.estimates.expected_output_tokens(continuation))
        heapq.heappush(self._deadlines, (continuation.deadline, next(self._seq), request_id))
        self.preemptions_total += 1
        return continuation

    # --- running tickets ---------------------------------------------------------------
    def generated(self, request_id: str, tokens: int, now: float) -> None:
        """A running ticket's engine request produced `tokens` more output tokens by `now`."""
        entry = self._running.get(request_id)
        if entry is None or tokens <= 0:
            return
        if entry.first_token_at is None:
            entry.first_token_at = now
            self.estimates.observe_prefill(entry.ticket.prompt_tokens, now - entry.dispatched_at)
        entry.generated += tokens
        self._running_output_left -= tokens
        self.estimates.tokens_generated(tokens, now)

    def release(self, request_id: str, now: float, *, completed: bool = False) -> Stage | None:
        """End a ticket wherever it is; returns where it was (None: already ended). A completed
        ticket's length (as `generated` reported it) feeds the output-length estimate."""
        ticket = self._queued.get(request_id)
        if ticket is not None:
            self._remove_queued(ticket)
            return "queued"
        entry = self._running.get(request_id)
        if entry is None:
            return None
        self._leave_running(entry, now)
        self._quotas.ended(entry.ticket)
        if completed:
            self.estimates.observe_completion(entry.generated, entry.ticket)
        return "running"

    def _leave_running(self, entry: _Running, now: float) -> None:
        del self._running[entry.ticket.request_id]
        self._running_output_left -= entry.expected_output - entry.generated
        if not self._running:
            self._running_output_left = 0.0  # no rounding drift survives an idle engine
        self._running_per_class[entry.ticket.traffic_class] -= 1
        self.ledger.release(entry.ticket)
        self.estimates.running_changed(len(self._running), now)

    def _remove_queued(self, ticket: Ticket) -> None:
        del self._queued[ticket.request_id]
        self._queues[ticket.traffic_class].remove(ticket)
        self._backlog.remove(ticket)
        self._quotas.ended(ticket)

    # --- state, for metrics and tests --------------------------------------------------
    def stage(self, request_id: str) -> Stage | None:
        if request_id in self._queued:
            return "queued"
        return "running" if request_id in self._running else None

    def queue_depth(self, traffic_class: TrafficClass) -> int:
        return len(self._queues[traffic_class])

    def oldest_queued_age(self, traffic_class: TrafficClass, now: float) -> float:
        oldest = self._queues[traffic_class].oldest_arrival()
        return 0.0 if oldest is None else max(0.0, now - oldest)

    def running_count(self, traffic_class: TrafficClass | None = None) -> int:
        if traffic_class is None:
            return len(self._running)
        return self._running_per_class[traffic_class]

    def running_tickets(self) -> list[Ticket]:
        return [e.ticket for e in self._running.values()]

    def is_idle(self) -> bool:
        return not self._queued and not self._running and self.ledger.is_idle()
