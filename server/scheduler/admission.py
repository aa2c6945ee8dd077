"""Whether a ticket may wait for the engine, decided before anything awaits; and the waits
that admission, Retry-After and the autoscaling pressure predict.

A ticket is refused if it could never fit its class's budgets, if its tenant is over a quota
(`quotas.py`) or holds its share of the class queue, if its class queue is full (by count or by
tokens), or if its predicted completion, plus `estimates.admission_margin` of it, falls past its
deadline. The prediction is the work running and queued ahead of it (`backlog.py`), drained at
the concurrency its class would run at, as the rate estimates (`estimates.py`) see the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from server.core.config import ClassConfig, TenantConfig
from server.scheduler.bulk_cap import BulkCap
from server.scheduler.estimates import RateEstimates
from server.scheduler.queues import ClassQueues
from server.scheduler.quotas import TenantQuotas
from server.scheduler.seats import Seats
from server.scheduler.types import BULK, RejectReason, Ticket, TrafficClass

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


class AdmissionControl:
    def __init__(
        self,
        classes: Mapping[TrafficClass, ClassConfig],
        tenants: Mapping[str, TenantConfig],
        margin: float,
        seats: Seats,
        queues: ClassQueues,
        estimates: RateEstimates,
        bulk_cap: BulkCap,
    ) -> None:
        self._classes = classes
        self.quotas = TenantQuotas(tenants)
        self._many_tenants = len(tenants) > 1
        self._margin = margin  # `estimates.admission_margin`
        self._seats = seats
        self._ledger = seats.ledger
        self._queues = queues
        self._estimates = estimates
        self._bulk_cap = bulk_cap
        self._mean_reserved = 1024.0  # tokens the admitted reserve, a moving average

    def decide(self, ticket: Ticket, now: float) -> Admitted | Rejected:
        if not self._ledger.ever_fits(ticket):
            return _too_large(ticket)
        refusal = self._check_tenant(ticket, now)
        if refusal is not None:
            return refusal
        tc = ticket.traffic_class
        class_config = self._classes[tc]
        queue = self._queues.by_class[tc]
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
            service = self._estimates.service_seconds(ticket, self._seats.sequences + ticket.n)
        predicted_start = now + wait
        predicted_end = predicted_start + service
        margin = self._margin * (predicted_end - now)
        if predicted_end + margin > ticket.deadline:
            return Rejected(
                ticket,
                RejectReason.DEADLINE_UNMEETABLE,
                (
                    f"predicted completion in {predicted_end - now:.3f}s (plus a "
                    f"{self._margin:.0%} margin) exceeds the deadline "
                    f"in {max(0.0, ticket.deadline - now):.3f}s"
                ),
                retry_after=max(1.0, predicted_start - now),
            )
        return Admitted(ticket, predicted_start)

    def admitted(self, ticket: Ticket, now: float) -> None:
        """`ticket`, which `decide` admitted, was queued at `now`."""
        self.quotas.admitted(ticket, now)
        self._mean_reserved += 0.05 * (ticket.reserved_tokens - self._mean_reserved)

    def _check_tenant(self, ticket: Ticket, now: float) -> Rejected | None:
        quota = self.quotas.check(ticket, now)
        if quota is not None:
            return Rejected(
                ticket,
                RejectReason.TENANT_QUOTA_EXCEEDED,
                quota.message,
                retry_after=quota.retry_after,
            )
        if self._many_tenants:
            class_config = self._classes[ticket.traffic_class]
            share = max(1, math.ceil(class_config.max_queued * class_config.tenant_queue_share))
            if self._queues.by_class[ticket.traffic_class].count_for(ticket.tenant) >= share:
                return Rejected(
                    ticket,
                    RejectReason.TENANT_QUOTA_EXCEEDED,
                    f"tenant {ticket.tenant!r} holds its share of the "
                    f"{ticket.traffic_class} queue ({share})",
                    retry_after=1.0,
                )
        return None

    # --- predictions ---------------------------------------------------------------------
    def predicted_wait(self, ticket: Ticket, now: float, *, fair: bool = True) -> float:
        """Expected seconds from now until `ticket` (not yet queued) would be dispatched: the
        work running and queued ahead of it (its tenant's fair share of the queue, or with
        `fair=False` all of it), drained by the engine at full concurrency."""
        return self._wait(ticket, fair=fair)[0]

    def pressure(self, traffic_class: TrafficClass, now: float) -> float:
        """Predicted queue wait for a typical new request over the class's deadline budget."""
        mean = int(self._mean_reserved)
        probe = Ticket("", "", traffic_class, "", now, now, mean // 2, mean - mean // 2)
        wait = self.predicted_wait(probe, now, fair=False)
        return wait / self._classes[traffic_class].deadline_s

    def _wait(self, ticket: Ticket, *, fair: bool) -> tuple[float, float]:
        """`predicted_wait`, and the ticket's own service seconds at the concurrency it would
        run at once dispatched from the queue (0.0 when it would start at once: then it
        runs among what runs now, and the caller knows how many that is). Admission needs
        both, and each reads the step-time estimate."""
        tc = ticket.traffic_class
        queues = self._queues
        queued_ahead = len(queues.interactive)
        if tc is BULK:
            queued_ahead += len(queues.bulk)
        if queued_ahead == 0 and self._ledger.fits(ticket, bulk_waiting=False):
            return 0.0, 0.0
        concurrency = self._concurrency(tc)
        estimates = self._estimates
        step = estimates.step_s(concurrency)
        own = estimates.service_seconds(ticket, concurrency)
        ahead = queues.backlog.seconds_ahead(
            tc, ticket.tenant if fair else None, own, estimates.prefill_tokens_per_s, step
        )
        left = self._seats.output_left
        ahead += (left if left > 0.0 else 0.0) * step
        return ahead / concurrency, own

    def _concurrency(self, traffic_class: TrafficClass) -> float:
        tokens_cap, _, seqs_cap = self._ledger.class_cap(traffic_class)
        if traffic_class is BULK:
            seqs_cap = min(seqs_cap, self._bulk_cap.idle())
        mean = self._mean_reserved
        by_tokens = tokens_cap / (mean if mean > 1.0 else 1.0)
        seqs = float(seqs_cap)
        concurrency = by_tokens if by_tokens < seqs else seqs
        return concurrency if concurrency > 1.0 else 1.0


def _too_large(ticket: Ticket) -> Rejected:
    many = ticket.n > 1
    return Rejected(
        ticket,
        RejectReason.REQUEST_TOO_LARGE,
        (
            f"the request reserves {ticket.reserved_tokens} tokens (prompt + max_tokens"
            + (f" for each of {ticket.n} choices) and {ticket.n} sequences, " if many else "), ")
            + f"more than the {ticket.traffic_class} budget allows; lower max_tokens"
            + (" or n" if many else "")
        ),
    )
