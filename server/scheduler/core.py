"""The scheduler's decisions, as a plain class: every method takes `now` and returns values.

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

The bulk cap (`bulk_cap.py`) is the step-time model's, corrected by the bulk controller
(`controller.py`), which every `poll` lets steer once a period by what chats measured where
the server wrote their tokens (`attainment.py`, fed by the shells).

Preemption has three causes and one mechanism. The bulk cap drops when chats arrive after a quiet
spell, or when the controller shrinks it: the bulk running beyond it stops at once when the
step time it causes is over the gap target as the controller corrects it (the cap itself aims
under that); under feedback, only when that step or what chats measured is far over the
target, and otherwise it leaves as it ends. And an interactive head that
has waited `preempt_bulk_after_s` with no budget room stops just enough bulk to fit, never
below bulk's minimum share. And an interactive head that waits for a LoRA adapter slot
(`adapters.py`) that only bulk holds stops all the bulk on one such adapter at once. Victims
are those cheapest to resume (the fewest tokens past their
last full KV block, which an engine with prefix caching must compute again), then the most
recently dispatched. The shell aborts their engine requests and calls `requeue`; the ticket
returns to the front of its tenant's bulk line as a continuation (prompt plus generated tokens,
the rest of max_tokens), keeping its arrival and deadline.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from server.core.config import SluiceConfig
from server.scheduler.adapters import AdapterSlots
from server.scheduler.attainment import ChatMeter
from server.scheduler.backlog import Backlog
from server.scheduler.budgets import BudgetLedger, BudgetLimits
from server.scheduler.bulk_cap import BulkCap, PrefillPacer
from server.scheduler.controller import BulkController
from server.scheduler.estimates import NEARLY_IDLE_OTHERS, RateEstimates
from server.scheduler.queues import TenantFairQueue
from server.scheduler.quotas import TenantQuotas
from server.scheduler.types import (
    BULK,
    INTERACTIVE,
    PreemptCause,
    RejectReason,
    SloTargets,
    Ticket,
    TrafficClass,
)

Stage = Literal["queued", "running"]

# Under feedback, a step the model predicts this far over the target, or a window of chats
# measured this far over it, stops bulk beyond the cap (less far, bulk leaves as it ends).
FAR_OVER = 1.2
# Bulk may start this many times as often as the bulk allowed turns over (`_start_share`).
TURNOVER_PACE = 2.0
# Under feedback, chats beyond this many more than usually run together are a burst: each
# one more stops a bulk sequence until the burst has passed (`_burst`).
BURST_MARGIN = 1
# Of a chat's TTFT target: a first token later than this after its dispatch waited in the
# engine, where bulk's prefills and steps are (the rest is the frontend's, or a queue's).
ENGINE_SHARE = 0.5

# While bulk's head waits for an adapter slot, bulk on the adapters that hold the slots goes on
# starting for this long, then stops starting, so that they end and free one (`_bulk_instead`).
ADAPTER_TURN_S = 10.0

# Made once: formatting an enum runs Python code, and a flood is refused this a million times.
# For the same reason the paths every request takes compare numbers where min() and max() would
# read better: in Python 3.11 one of those costs as much as three or four calls of our own.
_QUEUE_FULL = {tc: f"the {tc} queue is full; retry later" for tc in TrafficClass}


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


@dataclass(slots=True)
class Step:
    """What `poll` decided at one instant; the shell applies it and nothing more."""

    started: list[Ticket] = field(default_factory=list)  # dispatch to the engine now
    expired: list[Ticket] = field(default_factory=list)  # queued past their deadline: gone
    preempted: list[Ticket] = field(default_factory=list)  # abort, then `requeue` each
    wake_at: float | None = None  # poll again then, if nothing else happens first


@dataclass(slots=True)
class _Running:
    ticket: Ticket
    dispatched_at: float
    expected_output: float  # tokens it is expected to generate in this dispatch
    others_at_dispatch: int  # sequences already running when it was dispatched
    generated: int = 0  # tokens it generated in this dispatch, as the shell reported them
    first_token_at: float | None = None
    preempting: bool = False

    def resume_cost(self, block_size: int) -> int:
        """Tokens an engine with prefix caching computes again if this stops and resumes."""
        return (self.ticket.prompt_tokens + self.generated) % block_size


def _on_base_model(ticket: Ticket) -> bool:
    return ticket.adapter is None


class SchedulerCore:
    def __init__(self, config: SluiceConfig, limits: BudgetLimits) -> None:
        self.config = config
        self.ledger = BudgetLedger(limits, config.budgets)
        self.slots = AdapterSlots(limits.adapter_slots)
        self.estimates = RateEstimates(config.estimates)
        quantum = config.budgets.fairness_quantum_tokens
        self._queues = {c: TenantFairQueue(quantum_tokens=quantum) for c in TrafficClass}
        self._queued: dict[str, Ticket] = {}
        self._backlog = Backlog()  # the queued tickets' expected work
        self._running: dict[str, _Running] = {}
        self._running_output_left = 0.0  # expected output tokens minus generated, of running
        self._running_per_class = dict.fromkeys(TrafficClass, 0)  # sequences, not requests
        self._sequences = 0  # running, of both classes
        self._preempting = 0  # running tickets named for preemption, not yet requeued
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._quotas = TenantQuotas(config.tenants)
        slo = config.slo
        self.meter = ChatMeter()  # what chats got, as the shells report it
        self.controller = BulkController(
            slo.attainment_goal,
            enabled=slo.feedback and slo.cap_bulk and slo.bulk_cap_sequences is None,
        )
        self.bulk_cap = BulkCap(
            slo,
            self.estimates,
            self.controller,
            limit=self.ledger.class_cap(BULK)[2],
            min_share=config.budgets.bulk_min_share,
        )
        self._chats_quiet_since: float | None = -math.inf  # None while chats run or wait
        self._pacer = PrefillPacer()  # bulk prefill per engine step
        self._bulk_prefill_until = -math.inf  # when the last bulk prefill started should end
        self._mean_reserved = 1024.0
        self._many_tenants = len(config.tenants) > 1
        self._preempt_considered: str | None = None  # head already judged past its threshold
        self._bulk_slot_wait_since: float | None = None  # bulk's head has waited for a slot
        self.preemptions_total = 0  # requeued
        self.preempted_for = dict.fromkeys(PreemptCause, 0)  # named to stop, by cause

    # --- admission ---------------------------------------------------------------------
    def submit(self, ticket: Ticket, now: float) -> Admitted | Rejected:
        if ticket.request_id in self._queued or ticket.request_id in self._running:
            raise ValueError(f"duplicate request id {ticket.request_id!r}")
        tc = ticket.traffic_class
        if not self.ledger.ever_fits(ticket):
            return Rejected(
                ticket,
                RejectReason.REQUEST_TOO_LARGE,
                (
                    f"the request reserves {ticket.reserved_tokens} tokens (prompt + max_tokens"
                    + (
                        f" for each of {ticket.n} choices) and {ticket.n} sequences, "
                        if ticket.n > 1
                        else "), "
                    )
                    + f"more than the {tc} budget allows; lower max_tokens"
                    + (" or n" if ticket.n > 1 else "")
                ),
            )
        refusal = self._check_tenant(ticket, now)
        if refusal is not None:
            return refusal
        class_config = self.config.classes[tc]
        queue = self._queues[tc]
        if (
            len(queue) >= class_config.max_queued
            or queue.queued_tokens + ticket.reserved_tokens > class_config.max_queued_tokens
        ):
            drain, _ = self._wait(ticket, fair=True)
            return Rejected(
                ticket,
                RejectReason.OVERLOADED,
                _QUEUE_FULL[tc],
                retry_after=drain if drain > 1.0 else 1.0,
            )
        wait, service = self._wait(ticket, fair=True)
        if wait == 0.0:  # it runs among as many sequences as run now (else as many as fit)
            service = self.estimates.service_seconds(ticket, self._sequences + ticket.n)
        predicted_start = now + wait
        predicted_end = predicted_start + service
        margin = self.config.estimates.admission_margin * (predicted_end - now)
        if predicted_end + margin > ticket.deadline:
            return Rejected(
                ticket,
                RejectReason.DEADLINE_UNMEETABLE,
                (
                    f"predicted completion in {predicted_end - now:.3f}s (plus a "
                    f"{self.config.estimates.admission_margin:.0%} margin) exceeds the deadline "
                    f"in {max(0.0, ticket.deadline - now):.3f}s"
                ),
                retry_after=max(1.0, predicted_start - now),
            )
        self._admit(ticket, now)
        if tc is INTERACTIVE:
            self.estimates.observe_lead_in(now - ticket.arrival)
            self.estimates.chat_arrived(now)
            self._chats_changed(now)
        return Admitted(ticket, predicted_start)

    def _check_tenant(self, ticket: Ticket, now: float) -> Rejected | None:
        quota = self._quotas.check(ticket, now)
        if quota is not None:
            return Rejected(
                ticket,
                RejectReason.TENANT_QUOTA_EXCEEDED,
                quota.message,
                retry_after=quota.retry_after,
            )
        if self._many_tenants:
            class_config = self.config.classes[ticket.traffic_class]
            share = max(1, math.ceil(class_config.max_queued * class_config.tenant_queue_share))
            if self._queues[ticket.traffic_class].count_for(ticket.tenant) >= share:
                return Rejected(
                    ticket,
                    RejectReason.TENANT_QUOTA_EXCEEDED,
                    f"tenant {ticket.tenant!r} holds its share of the "
                    f"{ticket.traffic_class} queue ({share})",
                    retry_after=1.0,
                )
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
        if traffic_class is BULK:
            seqs_cap = min(seqs_cap, self.bulk_cap.idle())
        mean = self._mean_reserved
        by_tokens = tokens_cap / (mean if mean > 1.0 else 1.0)
        seqs = float(seqs_cap)
        concurrency = by_tokens if by_tokens < seqs else seqs
        return concurrency if concurrency > 1.0 else 1.0

    def predicted_wait(self, ticket: Ticket, now: float, *, fair: bool = True) -> float:
        """Expected seconds from now until `ticket` (not yet queued) would be dispatched: the
        work running and queued ahead of it (its tenant's fair share of the queue, or with
        `fair=False` all of it), drained by the engine at full concurrency."""
        return self._wait(ticket, fair=fair)[0]

    def _wait(self, ticket: Ticket, *, fair: bool) -> tuple[float, float]:
        """`predicted_wait`, and the ticket's own service seconds at the concurrency it would
        run at once dispatched from the queue (0.0 when it would start at once: then it
        runs among what runs now, and the caller knows how many that is). Admission needs
        both, and each reads the step-time estimate."""
        tc = ticket.traffic_class
        queued_ahead = len(self._queues[INTERACTIVE])
        if tc is BULK:
            queued_ahead += len(self._queues[BULK])
        if queued_ahead == 0 and self.ledger.fits(ticket, bulk_waiting=False):
            return 0.0, 0.0
        concurrency = self._concurrency(tc)
        step = self.estimates.steps.at(concurrency)
        own = self.estimates.service_seconds(ticket, concurrency)
        ahead = self._backlog.seconds_ahead(
            tc, ticket.tenant if fair else None, own, self.estimates.prefill_tokens_per_s, step
        )
        left = self._running_output_left
        ahead += (left if left > 0.0 else 0.0) * step
        return ahead / concurrency, own

    def pressure(self, traffic_class: TrafficClass, now: float) -> float:
        """Predicted queue wait for a typical new request over the class's deadline budget."""
        probe = Ticket(
            "",
            "",
            traffic_class,
            "",
            now,
            now,
            int(self._mean_reserved) // 2,
            int(self._mean_reserved) - int(self._mean_reserved) // 2,
        )
        wait = self.predicted_wait(probe, now, fair=False)
        return wait / self.config.classes[traffic_class].deadline_s

    # --- targets -----------------------------------------------------------------------
    def targets_for(self, ticket: Ticket) -> SloTargets | None:
        """The latency targets `ticket` is judged by: its tenant's, over its class's (None:
        a class without targets)."""
        slo = self.config.slo
        if ticket.traffic_class is BULK:
            stated = slo.bulk
            if stated.ttft_s is None and stated.itl_s is None:
                return None
            return SloTargets(stated.ttft_s or math.inf, stated.itl_s or math.inf)
        targets = self.bulk_cap.targets()
        tenant = self.config.tenants.get(ticket.tenant)
        own = None if tenant is None else tenant.slo
        if own is None:
            return targets
        return SloTargets(own.ttft_s or targets.ttft_s, own.itl_s or targets.itl_s)

    # --- the bulk cap ------------------------------------------------------------------
    def _chats(self) -> int:
        return self._running_per_class[INTERACTIVE] + len(self._queues[INTERACTIVE])

    def _chats_changed(self, now: float) -> None:
        chats = self._chats()
        self.estimates.chats_changed(chats, now)
        if chats:
            self._chats_quiet_since = None
        elif self._chats_quiet_since is None:
            self._chats_quiet_since = now

    def _hold_until(self) -> float | None:
        """While chats are about: None; after the last one: when bulk may grow past the
        chat cap again. That is `bulk_hold_s` after the last one ended, and not before chats
        arrive less often than once in `bulk_hold_s` (their rate, decaying while none comes).
        Arrivals are memoryless: however long the last quiet has lasted, under a steady
        stream of chats the next one comes as soon, and meets whatever bulk grew meanwhile:
        a step the chats' cap would not allow, or the prefill of what is stopped for them."""
        quiet = self._chats_quiet_since
        if quiet is None:
            return None
        hold = self.config.slo.bulk_hold_s
        return max(quiet + hold, self.estimates.chats_rarer_than(hold))

    def _chats_about(self, now: float) -> bool:
        """Chats run or wait, or the bulk hold after the last one has not ended."""
        hold_until = self._hold_until()
        return hold_until is None or now < hold_until

    def bulk_allowed(self, now: float) -> int:
        """Bulk sequences that may run now: capped while chats are about, the idle cap (the
        knee) otherwise. The model's cap leaves room for the chats there are (at least one)
        and for as many more as usually arrive while one runs, so that chats arriving together
        start within their gap target with nothing to preempt. Under feedback it leaves room
        for as many as usually run (at least one): the gaps it steers by are what chats got as
        they came and went, and a bulk request outlives many chats, so a cap that followed
        each would only ratchet up to its highest (bulk fills the cap at once, and leaves it
        only as it ends)."""
        if self._chats_about(now):
            expected = round(self.estimates.chats_together)
            if self.controller.enabled:
                return self.bulk_cap.with_chats(max(1, expected) + self._burst())
            return self.bulk_cap.with_chats(max(1, self._chats()) + expected)
        return self.bulk_cap.idle()

    def _burst(self) -> int:
        """Chats running or waiting beyond `BURST_MARGIN` more than usually run together.
        The controller's scale holds for the chats there usually are; Poisson arrivals bunch,
        and a step over twice as many chats as usual is longer by their sequences, for every
        chat in it: those of a burst miss together. Each chat of a burst leaves room for
        itself, by a bulk sequence stopped (resumed from the prefix cache, where the engine
        keeps one, once the burst has passed)."""
        usual = self.estimates.chats_together
        return max(0, self._chats() - max(1, round(usual)) - BURST_MARGIN)

    def _bulk_running(self) -> int:
        return self._running_per_class[BULK] - self._preempting

    # --- one decision: poll ------------------------------------------------------------
    def poll(self, now: float) -> Step:
        """Everything due at `now`: steer, expire, dispatch, preempt; and when to poll next."""
        if self.controller.due(now):
            self._steer(now)
        expired = self._expire_due(now)
        started = self._dispatch(now)
        preempted = self._preemptions(now)
        return Step(started, expired, preempted, self._wake_at(now))

    def _steer(self, now: float) -> None:
        """One period of the bulk controller: it may grow bulk only while bulk waits at a cap
        the scale sets (not the knee's or the budgets'), and shrink it only while bulk runs
        above its floor and no more than the cap allows (a cap below what runs already is
        waiting for bulk to end, or to be preempted)."""
        running = self._bulk_running()
        allowed = self.bulk_allowed(now)
        waiting = len(self._queues[BULK]) > 0
        chats = max(1, round(self.estimates.chats_together))
        self.controller.steer(
            now,
            self.meter,
            may_grow=running >= allowed and waiting and self.bulk_cap.scaled(chats),
            may_shrink=self.bulk_cap.floor() < running <= allowed,
            bulk_about=running > 0 or waiting,
        )

    def _dispatch(self, now: float) -> list[Ticket]:
        interactive = self._queues[INTERACTIVE]
        bulk = self._queues[BULK]
        started: list[Ticket] = []
        slots = self.slots
        while True:
            head = interactive.peek()
            if (
                head is not None
                and self.ledger.fits(head, bulk_waiting=len(bulk) > 0)
                and slots.fits(head)
            ):
                interactive.pop(head)
                started.append(self._start(head, now))
                continue
            bulk_head = bulk.peek()
            if bulk_head is not None and bulk_head.adapter is not None:
                bulk_head = self._bulk_around_slots(bulk_head, head, now)
            else:
                self._bulk_slot_wait_since = None  # it waits for no slot
            if (
                bulk_head is not None
                and self._bulk_may_start(bulk_head, now)
                and (
                    self.ledger.fits(bulk_head, bulk_waiting=True)
                    if head is None
                    else self.ledger.fits_bulk_floor(bulk_head)
                )
            ):
                bulk.pop(bulk_head)
                self._pacer.spend(
                    self._prefill_s(bulk_head),
                    self._start_share(bulk_head, now),
                    self._prefill_steps(bulk_head),
                )
                self._bulk_prefill_until = max(
                    self._bulk_prefill_until, now + self._prefill_s(bulk_head)
                )
                started.append(self._start(bulk_head, now))
                continue
            return started

    def _bulk_around_slots(
        self, bulk_head: Ticket, head: Ticket | None, now: float
    ) -> Ticket | None:
        """The bulk that may start now, given bulk's head on an adapter. A free slot is a
        chat's first: while a chat waits for one, bulk starts on the base model only (bulk
        started on an adapter now would only be stopped for the chat), and bulk takes a free
        slot only while no chat waits. A head that needs a slot it cannot have waits
        (`_bulk_instead`)."""
        slots = self.slots
        if head is not None and not slots.fits(head):
            return self._queues[BULK].first(_on_base_model)
        if slots.resident(bulk_head) or (head is None and slots.fits(bulk_head)):
            self._bulk_slot_wait_since = None  # it waits for no slot
            return bulk_head
        return self._bulk_instead(now)

    def _bulk_instead(self, now: float) -> Ticket | None:
        """What bulk starts while its head waits for an adapter slot: for `ADAPTER_TURN_S`,
        the first line's head that needs no slot (the base model's, or an adapter's that runs):
        the slots stay busy. Then only the base model's, so that the adapters that hold the
        slots end their turn and one frees (a line that always had a request waiting would
        otherwise keep its slot for ever)."""
        if self._bulk_slot_wait_since is None:
            self._bulk_slot_wait_since = now
        if now - self._bulk_slot_wait_since < ADAPTER_TURN_S:
            return self._queues[BULK].first(self.slots.resident)
        return self._queues[BULK].first(_on_base_model)

    def _bulk_may_start(self, ticket: Ticket, now: float) -> bool:
        """Below the cap, and within the prefill the step-time target leaves room for: bulk
        resuming after a chat, or filling an idle engine, must not pile its prefills into one
        long step that a chat arriving then would wait behind."""
        if self._bulk_running() >= self.bulk_allowed(now):
            return False
        needs = self._pacing(ticket, now)
        return needs is None or self._pacer.allows(*needs)

    def _pacing(self, ticket: Ticket, now: float) -> tuple[float, float] | None:
        """What the pacer must hold for `ticket` to start: (prefill seconds, least share of
        the bucket); None: it starts at once. Below bulk's floor a start is not paced, unless
        the controller has slowed the pace (first tokens late behind bulk's prefills): then it
        waits for the bucket to refill what the last start took, and no more."""
        below_floor = self._bulk_running() < self.bulk_cap.floor()
        if below_floor and self.controller.pace >= 1.0:
            return None
        self._pace(now)
        if below_floor:
            return 0.0, 0.0
        return self._prefill_s(ticket), self._start_share(ticket, now)

    def _start_share(self, ticket: Ticket, now: float) -> float:
        """The least share of a step's prefill headroom one bulk start takes while chats are
        about, whatever its prefill: one start per engine step, or more where the bulk allowed
        turns over faster (`TURNOVER_PACE` times the rate that replaces it, with each request's
        expected output as its steps). Bulk started together ends together (closed-loop
        clients, a batch's lines: the same lengths), and a cohort that returns at once brings
        every start's prefill, and the server's own work on each request, into the same few
        steps, where a chat arriving waits behind them. Spread once, the starts stay spread:
        each follows the end of the one it replaces. Within bulk's guaranteed minimum share
        a start takes none."""
        if not self._chats_about(now) or self.ledger.fits_bulk_floor(ticket):
            return 0.0
        turnover_steps = max(1.0, self.estimates.expected_output_tokens(ticket))
        return min(1.0, turnover_steps / (TURNOVER_PACE * max(1, self.bulk_allowed(now))))

    def _pace(self, now: float) -> None:
        step = self.estimates.steps.at(self._sequences + 1)
        headroom = self.bulk_cap.prefill_headroom(step, chats_about=self._chats_about(now))
        self._pacer.update(now, headroom, step, self.controller.pace)

    def _prefill_tokens(self, ticket: Ticket) -> int:
        """Tokens the engine prefills for `ticket`: its whole prompt, or for a continuation
        what follows its last full KV block (an engine with prefix caching holds the rest)."""
        tokens = ticket.prompt_tokens
        if ticket.resumed_tokens:
            tokens = tokens % self.ledger.limits.block_size or 1
        return tokens

    def _prefill_s(self, ticket: Ticket) -> float:
        """Engine seconds to prefill `ticket`."""
        return self._prefill_tokens(ticket) / self.estimates.prefill_tokens_per_s

    def _prefill_steps(self, ticket: Ticket) -> int:
        """Engine steps `ticket`'s prefill spans: one, or its chunks on an engine that
        prefills a long prompt a chunk a step (a chat arriving meanwhile waits behind them)."""
        chunk = self.ledger.limits.prefill_chunk
        return -(-self._prefill_tokens(ticket) // chunk) if chunk > 0 else 1

    def _start(self, ticket: Ticket, now: float) -> Ticket:
        del self._queued[ticket.request_id]
        expected_output = self._backlog.remove(ticket)
        self.ledger.acquire(ticket)
        self.slots.acquire(ticket)
        self._running[ticket.request_id] = _Running(
            ticket, now, expected_output, others_at_dispatch=self._sequences
        )
        self._running_output_left += expected_output
        self._running_per_class[ticket.traffic_class] += ticket.n
        self._sequences += ticket.n
        self.estimates.running_changed(self._sequences, now)
        self.estimates.prefill_dispatched(self._prefill_s(ticket))
        return ticket

    def _expire_due(self, now: float) -> list[Ticket]:
        expired: list[Ticket] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, request_id = heapq.heappop(heap)
            ticket = self._queued.get(request_id)
            if ticket is not None:
                self._remove_queued(ticket, now)
                expired.append(ticket)
        return expired

    def _wake_at(self, now: float) -> float | None:
        """The earliest of: a queued ticket's deadline, the moment the interactive head may
        preempt bulk, and, while bulk waits below what it may grow to, the next paced bulk
        start or the end of the bulk hold."""
        heap = self._deadlines
        while heap and heap[0][2] not in self._queued:
            heapq.heappop(heap)
        times = [heap[0][0]] if heap else []
        preempt_at = self._preempt_time()
        if preempt_at is not None:
            times.append(preempt_at)
        if self.controller.enabled and self._running_per_class[BULK] and self.meter.has_gaps:
            times.append(max(now, self.controller.next_at))
        bulk_head = self._queues[BULK].peek()
        if bulk_head is not None:
            running = self._bulk_running()
            if running < self.bulk_allowed(now):
                needs = self._pacing(bulk_head, now)
                ready = now if needs is None else self._pacer.ready_at(*needs)
                if ready > now:  # else the budgets hold it, and a release will poll
                    times.append(ready)
            hold_until = self._hold_until()
            if hold_until is not None and now < hold_until and running < self.bulk_cap.idle():
                times.append(hold_until)
        return times[0] if len(times) == 1 else min(times, default=None)  # (most: one deadline)

    def _preempt_time(self) -> float | None:
        if self._running_per_class[BULK] == 0:
            return None  # (asked first: the usual answer, and the setting is a property)
        after = self.config.budgets.preempt_bulk_after_s
        if after is None:
            return None
        head = self._queues[INTERACTIVE].peek()
        if head is None or head.request_id == self._preempt_considered:
            return None
        return head.arrival + after

    # --- preemption --------------------------------------------------------------------
    def _preemptions(self, now: float) -> list[Ticket]:
        """Running bulk to stop now: what exceeds the cap while chats run, and what a chat
        that waited its threshold without room needs. Each ticket is named once; it keeps its
        budgets until the shell calls `requeue` (or `release`, if it ended meanwhile)."""
        chosen: list[Ticket] = []
        if self._running_per_class[BULK] == 0:
            return chosen  # no bulk runs: neither pick has anything to name
        for pick in (self._over_cap, self._for_waiting_chat, self._for_adapter_slot):
            for entry in pick(now):  # named before the next pick, so named once
                entry.preempting = True
                self._preempting += 1
                chosen.append(entry.ticket)
        return chosen

    def _stopping(self, cause: PreemptCause, entries: list[_Running]) -> list[_Running]:
        self.preempted_for[cause] += len(entries)
        return entries

    def _victims(self) -> list[_Running]:
        """Running preemptible bulk not yet named, the cheapest to resume first."""
        block = self.ledger.limits.block_size
        return sorted(
            (
                e
                for e in self._running.values()
                if e.ticket.traffic_class is BULK and e.ticket.preemptible and not e.preempting
            ),
            key=lambda e: (e.resume_cost(block), -e.dispatched_at),
        )

    def _over_cap(self, now: float) -> list[_Running]:
        running = self._bulk_running()
        if running <= 0:
            return []  # nothing over any cap (what bulk is allowed is never below 0)
        excess = running - self.bulk_allowed(now)
        if excess <= 0 or not self._chats():
            return []
        # The cap aims under the target; between the two, bulk ends by itself sooner than a
        # resumed request would repay the prefill it must redo. Under feedback the cap moves
        # with every correction, and each preemption costs a prefill that chats wait behind:
        # stopping bulk whenever chats measured over their target made a cycle on a noisy
        # host (a stop, a prefill, misses, the cap grown back). So bulk beyond the cap leaves
        # as it ends, unless chats measure far over their target, or the model predicts a
        # step far over it (bulk grown while no chat was about); under feedback, a burst of
        # chats stops as much bulk as the burst has chats.
        if self.controller.median > FAR_OVER:
            return self._stopping(PreemptCause.CHATS_FAR_OVER, self._victims()[:excess])
        step = self.estimates.steps.at(self._sequences - self._preempting)
        limit = self.bulk_cap.step_limit()
        if self.controller.enabled:
            limit *= FAR_OVER
        if step > limit:
            return self._stopping(PreemptCause.STEP_OVER_TARGET, self._victims()[:excess])
        burst = self._burst() if self.controller.enabled else 0
        if burst:
            return self._stopping(PreemptCause.CHAT_BURST, self._victims()[: min(excess, burst)])
        return []

    def _for_waiting_chat(self, now: float) -> list[_Running]:
        """Returns [] unless the interactive head has waited its threshold, does not fit, and
        stopping bulk (down to bulk's minimum share) makes it fit."""
        preempt_at = self._preempt_time()
        if preempt_at is None or now < preempt_at:
            return []
        head = self._queues[INTERACTIVE].peek()
        assert head is not None
        self._preempt_considered = head.request_id
        leaving = [e.ticket for e in self._running.values() if e.preempting]
        if self.ledger.fits(head, bulk_waiting=True, freeing=leaving):
            return []  # what is already being stopped makes room
        chosen: list[_Running] = []
        for entry in self._victims():
            chosen.append(entry)
            if self.ledger.fits(
                head, bulk_waiting=True, freeing=leaving + [e.ticket for e in chosen]
            ):
                return self._stopping(PreemptCause.WAITING_CHAT, chosen)
        return []  # even stopping every bulk request would not make room

    def _for_adapter_slot(self, now: float) -> list[_Running]:
        """Returns [] unless the interactive head waits for an adapter slot that bulk alone
        holds: then all the bulk on one such adapter (the fewest sequences) stops, at once (a
        slot frees only when the last request on it ends, which a flood may never let happen).
        Not while a slot is already being freed, nor from an adapter with bulk that cannot
        resume."""
        head = self._queues[INTERACTIVE].peek()
        if head is None or self.slots.fits(head):
            return []
        held = self.slots.held_by_bulk_only()
        on: dict[str, list[_Running]] = {adapter: [] for adapter in held}
        for entry in self._running.values():
            adapter = entry.ticket.adapter
            if adapter is not None and adapter in on:
                on[adapter].append(entry)
        best: list[_Running] | None = None
        for entries in on.values():
            if all(e.preempting for e in entries):
                return []  # its slot frees as they are requeued
            if any(not e.ticket.preemptible for e in entries if not e.preempting):
                continue
            stopping = [e for e in entries if not e.preempting]
            if best is None or sum(e.ticket.n for e in stopping) < sum(e.ticket.n for e in best):
                best = stopping
        return [] if best is None else self._stopping(PreemptCause.ADAPTER_SLOT, best)

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
        self._queues[BULK].push_front(continuation)
        self._queued[request_id] = continuation
        self._backlog.add(continuation, self.estimates.expected_output_tokens(continuation))
        heapq.heappush(self._deadlines, (continuation.deadline, next(self._seq), request_id))
        self.preemptions_total += 1
        return continuation

    # --- running tickets ---------------------------------------------------------------
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
        estimates = self.estimates
        seen_now = False  # the estimates saw tokens at `now`
        unseen = 0  # tokens at `now` not yet added to them
        for request_id, tokens, completed in outputs:
            entry = running.get(request_id)
            if entry is not None and tokens > 0:
                if entry.first_token_at is None:
                    self._first_token(entry, now)
                entry.generated += tokens
                self._running_output_left -= tokens
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

    def _first_token(self, entry: _Running, now: float) -> None:
        entry.first_token_at = now
        ticket = entry.ticket
        if not ticket.resumed_tokens:  # a continuation's prefix is mostly cached
            self.estimates.observe_prefill(
                ticket.prompt_tokens, now - entry.dispatched_at, entry.others_at_dispatch
            )
        if ticket.traffic_class is INTERACTIVE:
            if entry.others_at_dispatch <= NEARLY_IDLE_OTHERS:
                self.estimates.observe_engine_ttft(now - entry.dispatched_at)
            if self.controller.enabled:
                self.controller.first_token(late=self._late_behind_bulk(entry, now))

    def _late_behind_bulk(self, entry: _Running, now: float) -> bool:
        """Whether a chat's first token came late behind bulk's prefills: past its TTFT target,
        more than `ENGINE_SHARE` of it after its dispatch (where bulk's prefills and steps are
        what it waits behind), and with a bulk prefill (as predicted from its start) under way
        while it waited in the engine, or as long before its dispatch (in the step it joined).
        Judged where the scheduler sees the token, the frontend's writing of it aside."""
        targets = self.targets_for(entry.ticket)
        if targets is None:
            return False
        in_engine = now - entry.dispatched_at
        return (
            now - entry.ticket.arrival > targets.ttft_s
            and in_engine > ENGINE_SHARE * targets.ttft_s
            and self._bulk_prefill_until >= entry.dispatched_at - in_engine
        )

    def release(self, request_id: str, now: float, *, completed: bool = False) -> Stage | None:
        """End a ticket wherever it is; returns where it was (None: already ended). A completed
        ticket's length (as `generated` reported it) feeds the output-length estimate."""
        ticket = self._queued.get(request_id)
        if ticket is not None:
            self._remove_queued(ticket, now)
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
        self._running_per_class[entry.ticket.traffic_class] -= entry.ticket.n
        self._sequences -= entry.ticket.n
        if entry.preempting:
            self._preempting -= 1
        self.ledger.release(entry.ticket)
        self.slots.release(entry.ticket)
        self.estimates.running_changed(self._sequences, now)
        if entry.ticket.traffic_class is INTERACTIVE:
            self._chats_changed(now)

    def _remove_queued(self, ticket: Ticket, now: float) -> None:
        del self._queued[ticket.request_id]
        self._queues[ticket.traffic_class].remove(ticket)
        self._backlog.remove(ticket)
        self._quotas.ended(ticket)
        if ticket.traffic_class is INTERACTIVE:
            self._chats_changed(now)

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
        """Running sequences (a request with n choices runs n), of one class or all."""
        if traffic_class is None:
            return self._sequences
        return self._running_per_class[traffic_class]

    def running_tickets(self) -> list[Ticket]:
        return [e.ticket for e in self._running.values()]

    def is_idle(self) -> bool:
        return not self._queued and not self._running and self.ledger.is_idle()
