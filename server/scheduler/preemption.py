"""Which running bulk to stop now, so that chats keep their targets.

Preemption has three causes and one mechanism. The bulk cap drops when chats arrive after a
quiet spell, or when the controller shrinks it: the bulk running beyond it stops at once when
the step time it causes is over the gap target as the controller corrects it (the cap itself
aims under that); under feedback, only when that step or what chats measured is far over the
target, and otherwise it leaves as it ends. And an interactive head that has waited
`budgets.preempt_bulk_after_s` with no budget room stops just enough bulk to fit, never below
bulk's minimum share. And an interactive head that waits for a LoRA adapter slot
(`adapters.py`) that only bulk holds stops all the bulk on one such adapter at once. Victims
are those cheapest to resume (the fewest tokens past their last full KV block, which an engine
with prefix caching must compute again), then the most recently dispatched. The shell aborts
their engine requests and calls `SchedulerCore.requeue`; the ticket returns to the front of its
tenant's bulk line as a continuation (prompt plus generated tokens, the rest of max_tokens),
keeping its arrival and deadline.
"""

from __future__ import annotations

from server.scheduler.bulk_allowance import BulkAllowance
from server.scheduler.bulk_cap import BulkCap
from server.scheduler.controller import BulkController
from server.scheduler.estimates import RateEstimates
from server.scheduler.queues import ClassQueues
from server.scheduler.seats import Running, Seats
from server.scheduler.types import BULK, PreemptCause, Ticket

# Under feedback, a step the model predicts this far over the target, or a window of chats
# measured this far over it, stops bulk beyond the cap (less far, bulk leaves as it ends).
FAR_OVER = 1.2


class Preemption:
    def __init__(
        self,
        after_s: float | None,
        seats: Seats,
        queues: ClassQueues,
        bulk: BulkAllowance,
        estimates: RateEstimates,
        controller: BulkController,
        bulk_cap: BulkCap,
    ) -> None:
        self._after_s = after_s  # `budgets.preempt_bulk_after_s`
        self._seats = seats
        self._queues = queues
        self._bulk = bulk
        self._estimates = estimates
        self._controller = controller
        self._bulk_cap = bulk_cap
        self._considered: str | None = None  # head already judged past its threshold
        self.preempted_for = dict.fromkeys(PreemptCause, 0)  # named to stop, by cause

    def choose(self, now: float, allowed: int | None) -> list[Ticket]:
        """Running bulk to stop now: what exceeds the cap (`allowed`: the bulk sequences that
        may run now, `BulkAllowance.allowed`, if the poll has read it) while chats run, what a
        chat that waited its threshold without room needs, and what holds the adapter slot a
        chat waits for. Each ticket is named once; it keeps its budgets until the shell calls
        `requeue` (or `release`, if it ended meanwhile)."""
        chosen: list[Ticket] = []
        if self._seats.per_class[BULK] == 0:
            return chosen  # no bulk runs: no pick has anything to name
        # Each pick's are named before the next pick looks, so each is named once.
        self._name(self._over_cap(now, allowed), chosen)
        self._name(self._for_waiting_chat(now), chosen)
        self._name(self._for_adapter_slot(), chosen)
        return chosen

    def _name(self, entries: list[Running], chosen: list[Ticket]) -> None:
        for entry in entries:
            self._seats.stop(entry)
            chosen.append(entry.ticket)

    def at(self) -> float | None:
        """When the interactive head, if it still waits, may stop bulk to make room."""
        if self._seats.per_class[BULK] == 0:
            return None  # (asked first: the usual answer)
        after = self._after_s
        if after is None:
            return None
        head = self._queues.interactive.peek()
        if head is None or head.request_id == self._considered:
            return None
        return head.arrival + after

    def _stopping(self, cause: PreemptCause, entries: list[Running]) -> list[Running]:
        self.preempted_for[cause] += len(entries)
        return entries

    def _victims(self) -> list[Running]:
        """Running preemptible bulk not yet named, the cheapest to resume first."""
        block = self._seats.ledger.limits.block_size
        return sorted(
            (
                e
                for e in self._seats.running.values()
                if e.ticket.traffic_class is BULK and e.ticket.preemptible and not e.preempting
            ),
            key=lambda e: (e.resume_cost(block), -e.dispatched_at),
        )

    def _over_cap(self, now: float, allowed: int | None) -> list[Running]:
        seats = self._seats
        running = seats.bulk()
        if running <= 0:
            return []  # nothing over any cap (what bulk is allowed is never below 0)
        excess = running - (self._bulk.allowed(now) if allowed is None else allowed)
        if excess <= 0 or not self._bulk.chats():
            return []
        # The cap aims under the target; between the two, bulk ends by itself sooner than a
        # resumed request would repay the prefill it must redo. Under feedback the cap moves
        # with every correction, and each preemption costs a prefill that chats wait behind:
        # stopping bulk whenever chats measured over their target made a cycle on a noisy
        # host (a stop, a prefill, misses, the cap grown back). So bulk beyond the cap leaves
        # as it ends, unless chats measure far over their target, or the model predicts a
        # step far over it (bulk grown while no chat was about); under feedback, a burst of
        # chats stops as much bulk as the burst has chats.
        controller = self._controller
        if controller.median > FAR_OVER:
            return self._stopping(PreemptCause.CHATS_FAR_OVER, self._victims()[:excess])
        step = self._estimates.step_s(seats.sequences - seats.preempting)
        limit = self._bulk_cap.step_limit()
        if controller.enabled:
            limit *= FAR_OVER
        if step > limit:
            return self._stopping(PreemptCause.STEP_OVER_TARGET, self._victims()[:excess])
        burst = self._bulk.burst() if controller.enabled else 0
        if burst:
            return self._stopping(PreemptCause.CHAT_BURST, self._victims()[: min(excess, burst)])
        return []

    def _for_waiting_chat(self, now: float) -> list[Running]:
        """Returns [] unless the interactive head has waited its threshold, does not fit, and
        stopping bulk (down to bulk's minimum share) makes it fit."""
        preempt_at = self.at()
        if preempt_at is None or now < preempt_at:
            return []
        head = self._queues.interactive.peek()
        assert head is not None
        self._considered = head.request_id
        ledger = self._seats.ledger
        leaving = [e.ticket for e in self._seats.running.values() if e.preempting]
        if ledger.fits(head, bulk_waiting=True, freeing=leaving):
            return []  # what is already being stopped makes room
        chosen: list[Running] = []
        for entry in self._victims():
            chosen.append(entry)
            if ledger.fits(head, bulk_waiting=True, freeing=leaving + [e.ticket for e in chosen]):
                return self._stopping(PreemptCause.WAITING_CHAT, chosen)
        return []  # even stopping every bulk request would not make room

    def _for_adapter_slot(self) -> list[Running]:
        """Returns [] unless the interactive head waits for an adapter slot that bulk alone
        holds: then all the bulk on one such adapter (the fewest sequences) stops, at once (a
        slot frees only when the last request on it ends, which a flood may never let happen).
        Not while a slot is already being freed, nor from an adapter with bulk that cannot
        resume."""
        slots = self._seats.slots
        head = self._queues.interactive.peek()
        if head is None or slots.fits(head):
            return []
        held = slots.held_by_bulk_only()
        on: dict[str, list[Running]] = {adapter: [] for adapter in held}
        for entry in self._seats.running.values():
            adapter = entry.ticket.adapter
            if adapter is not None and adapter in on:
                on[adapter].append(entry)
        best: list[Running] | None = None
        for entries in on.values():
            if all(e.preempting for e in entries):
                return []  # its slot frees as they are requeued
            if any(not e.ticket.preemptible for e in entries if not e.preempting):
                continue
            stopping = [e for e in entries if not e.preempting]
            if best is None or sum(e.ticket.n for e in stopping) < sum(e.ticket.n for e in best):
                best = stopping
        return [] if best is None else self._stopping(PreemptCause.ADAPTER_SLOT, best)
