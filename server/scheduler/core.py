"""The scheduler's decisions, as plain objects: every method takes `now` and returns values.

No asyncio, no sockets, no wall clock: the asyncio runtime (`runtime.py`) and the simulator
(`server/simulation/continuous.py`) drive the same `SchedulerCore`. One core serves one model.

Life of a ticket: `submit` admits it (queued) or rejects it with a reason. `poll(now)` returns
one `Step`: the queued tickets whose deadline has passed (expired), the queued tickets that fit
the budgets and the bulk cap (started: interactive first, bulk within its share and its cap,
DRR across tenants), the running bulk tickets to stop (preempted), and when to poll again if
nothing else happens. The shell applies the step and nothing more. `release` ends a ticket
wherever it is (queued: cancelled; running: finished, aborted or expired) and gives its budgets
back. Ending an unknown or already-ended ticket is a no-op, so a late output never revives an
expired request. While a ticket runs, the shell reports each output's tokens to `generated`
(or a whole engine step's outputs, and the completions among them, to `generated_many`): the
core's count of what it produced, and the rate estimates' input.

Each decision is one object's, handed its slice of the configuration; `SchedulerCore` composes
them and keeps the tickets' moves between them:

- admission and refusals, and the waits it predicts: `AdmissionControl` (`admission.py`),
  with the tenants' quotas (`quotas.py`);
- the class and tenant queues, their backlog and deadlines: `ClassQueues` (`queues.py`);
- seats and budgets, what running tickets hold: `Seats` (`seats.py`), `BudgetLedger`;
- how much bulk may run and start, steered by the bulk controller: `BulkAllowance`
  (`bulk_allowance.py`), over `BulkCap`, `PrefillPacer` and `BulkController`;
- which running bulk stops, and why: `Preemption` (`preemption.py`);
- who gets a LoRA adapter slot: `AdapterSlots` (`adapters.py`);
- the latency targets a ticket is judged by: `Targets` (`targets.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from server.core.config import SluiceConfig
from server.scheduler.adapters import AdapterSlots
from server.scheduler.admission import AdmissionControl, Admitted, Rejected
from server.scheduler.attainment import ChatMeter
from server.scheduler.budgets import BudgetLedger, BudgetLimits
from server.scheduler.bulk_allowance import BulkAllowance
from server.scheduler.bulk_cap import BulkCap
from server.scheduler.controller import BulkController
from server.scheduler.estimates import RateEstimates
from server.scheduler.preemption import Preemption
from server.scheduler.queues import ClassQueues
from server.scheduler.seats import Running, Seats
from server.scheduler.slo import SloTargets
from server.scheduler.targets import Targets
from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass

Stage = Literal["queued", "running"]


@dataclass(slots=True)
class Step:
    """What `poll` decided at one instant; the shell applies it and nothing more."""

    started: list[Ticket] = field(default_factory=list)  # dispatch to the engine now
    expired: list[Ticket] = field(default_factory=list)  # queued past their deadline: gone
    preempted: list[Ticket] = field(default_factory=list)  # abort, then `requeue` each
    wake_at: float | None = None  # poll again then, if nothing else happens first


class SchedulerCore:
    def __init__(self, config: SluiceConfig, limits: BudgetLimits) -> None:
        budgets, slo = config.budgets, config.slo
        self.ledger = ledger = BudgetLedger(limits, budgets)
        self.estimates = estimates = RateEstimates(config.estimates)
        self.meter = meter = ChatMeter()  # what chats got, as the shells report it
        self.controller = controller = BulkController.for_slo(slo)
        bulk_limit = ledger.class_cap(BULK)[2]
        self.bulk_cap = cap = BulkCap(
            slo, estimates, controller, limit=bulk_limit, min_share=budgets.bulk_min_share
        )
        self.targets = targets = Targets(slo, config.tenants, cap)
        self.queues = queues = ClassQueues(quantum_tokens=budgets.fairness_quantum_tokens)
        self.seats = seats = Seats(ledger, AdapterSlots(limits.adapter_slots))
        self._running = seats.running  # (the same dict: read for every output)
        margin = config.estimates.admission_margin
        self.admission = AdmissionControl(
            config.classes, config.tenants, margin, seats, queues, estimates, cap
        )
        self.quotas = self.admission.quotas
        self.bulk = BulkAllowance(
            slo.bulk_hold_s, limits, seats, queues, estimates, controller, cap, meter, targets
        )
        self.preemption = Preemption(
            budgets.preempt_bulk_after_s, seats, queues, self.bulk, estimates, controller, cap
        )
        self.preempted_for = self.preemption.preempted_for  # named to stop, by cause
        self.preemptions_total = 0  # requeued

    @property
    def slots(self) -> AdapterSlots:
        return self.seats.slots

    # --- admission -----------------------------------------------------------------------
    def submit(self, ticket: Ticket, now: float) -> Admitted | Rejected:
        if ticket.request_id in self.queues or ticket.request_id in self._running:
            raise ValueError(f"duplicate request id {ticket.request_id!r}")
        decision = self.admission.decide(ticket, now)
        if isinstance(decision, Rejected):
            return decision
        self.queues.add(ticket, self.estimates.expected_output_tokens(ticket))
        self.admission.admitted(ticket, now)
        if ticket.traffic_class is INTERACTIVE:
            self.estimates.observe_lead_in(now - ticket.arrival)
            self.estimates.chat_arrived(now)
            self.bulk.chat_came(ticket, now)
        return decision

    def predicted_wait(self, ticket: Ticket, now: float, *, fair: bool = True) -> float:
        return self.admission.predicted_wait(ticket, now, fair=fair)

    def pressure(self, traffic_class: TrafficClass, now: float) -> float:
        return self.admission.pressure(traffic_class, now)

    def targets_for(self, ticket: Ticket) -> SloTargets | None:
        return self.targets.of(ticket)

    def bulk_allowed(self, now: float) -> int:
        return self.bulk.allowed(now)

    # --- one decision: poll --------------------------------------------------------------
    def poll(self, now: float) -> Step:
        """Everything due at `now`: steer, expire, dispatch, preempt; and when to poll next."""
        self.bulk.steer(now)
        expired = self.queues.expire(now)
        for ticket in expired:
            self._left_queue(ticket, now)
        started, allowed = self._dispatch(now)
        preempted = self.preemption.choose(now, allowed)
        return Step(started, expired, preempted, self._wake_at(now, allowed))

    def _dispatch(self, now: float) -> tuple[list[Ticket], int | None]:
        """Interactive's head while it fits; else bulk's, as the slots and the bulk allowance
        let it start; until neither starts. Returns what started, and the bulk allowed after,
        if a bulk head read it: preemption and the next wakeup read it too, and neither
        changes it (read again after a start, which may; and not at all with no bulk head)."""
        interactive, bulk = self.queues.interactive, self.queues.bulk
        seats, slots, allowance = self.seats, self.slots, self.bulk
        started: list[Ticket] = []
        allowed: int | None = None
        kept = allowance.slots_kept(now)  # (no start changes whether chats are about)
        while True:
            head = interactive.peek()
            if head is not None and seats.fits(head, bulk_waiting=len(bulk) > 0):
                started.append(self._start(head, now))
                allowed = None
                continue
            bulk_head = slots.bulk_head(bulk, head, now, kept)
            if bulk_head is None:
                return started, allowed
            if allowed is None:
                allowed = allowance.allowed(now)
            if not allowance.start(bulk_head, head, now, allowed):
                return started, allowed
            started.append(self._start(bulk_head, now))
            allowed = None

    def _start(self, ticket: Ticket, now: float) -> Ticket:
        expected_output = self.queues.start(ticket)
        self.seats.take(ticket, now, expected_output)
        self.estimates.running_changed(self.seats.sequences, now, self.slots.running())
        self.estimates.prefill_dispatched(self.bulk.prefill_s(ticket))
        return ticket

    def _wake_at(self, now: float, bulk_allowed: int | None) -> float | None:
        """The earliest of: a queued ticket's deadline, the moment the interactive head may
        preempt bulk, and when what bulk may do changes by itself (`bulk_allowed` now, if
        read)."""
        deadline = self.queues.next_deadline()
        times = [] if deadline is None else [deadline]
        preempt_at = self.preemption.at()
        if preempt_at is not None:
            times.append(preempt_at)
        times += self.bulk.wake_times(now, bulk_allowed)
        return times[0] if len(times) == 1 else min(times, default=None)  # (most: one deadline)

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
                "a request with nothing left to generate is finished, not requeued"
            )
        self._leave_running(entry, now)
        continuation = ticket.continued(generated_tokens)
        expected_output = self.estimates.expected_output_tokens(continuation)
        self.queues.add(continuation, expected_output, front=True)
        self.preemptions_total += 1
        return continuation

    # --- running tickets -----------------------------------------------------------------
    def generated(self, request_id: str, tokens: int, now: float) -> None:
        """A running ticket's engine request produced `tokens` more output tokens by `now`."""
        self.generated_many(((request_id, tokens, False),), now)

    def generated_many(self, outputs: Iterable[tuple[str, int, bool]], now: float) -> None:
        """An engine step's outputs, all by `now`: each (request id, tokens, completed) as
        `generated` and then, if completed, `release(completed=True)`, in order.

        One call per step rather than two per output: a simulated million requests make
        millions of outputs. The rate estimates see the instant's first tokens at once (that
        may close a window, which the next first-token observation reads); the rest of the
        instant's tokens only add to the window, so they are summed and added before anything
        that may replace it (a release)."""
        running = self._running
        seats = self.seats
        estimates = self.estimates
        seen_now = False  # the estimates saw tokens at `now`
        unseen = 0  # tokens at `now` not yet added to them
        for request_id, tokens, completed in outputs:
            entry = running.get(request_id)
            if entry is not None and tokens > 0:
                if entry.first_token_at is None:
                    self.bulk.first_token(entry, now)
                entry.generated += tokens
                seats.output_left -= tokens
                if seen_now:
                    unseen += tokens
                else:
                    estimates.tokens_generated(tokens, now)
                    seen_now = True
            if completed:
                if unseen:
                    estimates.tokens_generated(unseen, now)
                    unseen = 0
                self.release(request_id, now, completed=True)
        if unseen:
            estimates.tokens_generated(unseen, now)

    def release(self, request_id: str, now: float, *, completed: bool = False) -> Stage | None:
        """End a ticket wherever it is; returns where it was (None: already ended). A completed
        ticket's length (as `generated` reported it) feeds the output-length estimate."""
        ticket = self.queues.get(request_id)
        if ticket is not None:
            self.queues.remove(ticket)
            self._left_queue(ticket, now)
            return "queued"
        entry = self._running.get(request_id)
        if entry is None:
            return None
        self._leave_running(entry, now)
        self.quotas.ended(entry.ticket)
        if completed:
            self.estimates.observe_completion(entry.generated, entry.ticket)
        return "running"

    def _leave_running(self, entry: Running, now: float) -> None:
        self.seats.leave(entry)
        self.estimates.running_changed(self.seats.sequences, now, self.slots.running())
        if entry.ticket.traffic_class is INTERACTIVE:
            self.bulk.chat_went(entry.ticket, now)

    def _left_queue(self, ticket: Ticket, now: float) -> None:
        """`ticket` left its queue without starting: cancelled, or expired."""
        self.quotas.ended(ticket)
        if ticket.traffic_class is INTERACTIVE:
            self.bulk.chat_went(ticket, now)

    # --- state, for metrics and tests ----------------------------------------------------
    def stage(self, request_id: str) -> Stage | None:
        if request_id in self.queues:
            return "queued"
        return "running" if request_id in self._running else None

    def queue_depth(self, traffic_class: TrafficClass) -> int:
        return len(self.queues.by_class[traffic_class])

    def oldest_queued_age(self, traffic_class: TrafficClass, now: float) -> float:
        return self.queues.oldest_age(traffic_class, now)

    def running_count(self, traffic_class: TrafficClass | None = None) -> int:
        """Running sequences (a request with n choices runs n), of one class or all."""
        if traffic_class is None:
            return self.seats.sequences
        return self.seats.per_class[traffic_class]

    def running_tickets(self) -> list[Ticket]:
        return self.seats.tickets()

    def is_idle(self) -> bool:
        return not self.queues and self.seats.is_idle()
