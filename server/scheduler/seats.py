"""The engine's seats: the tickets running in it, and what each holds while it runs.

A ticket takes its seat at dispatch and holds its budgets (`budgets.py`) and its adapter's
slot (`adapters.py`) until it leaves: finished, aborted, expired, or preempted and requeued.
While it runs, the shell reports what it generated (`SchedulerCore.generated_many`), which the
seat keeps: how far it got, and how much of its expected output is left to run.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.scheduler.adapters import AdapterSlots
from server.scheduler.budgets import BudgetLedger
from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass


@dataclass(slots=True)
class Running:
    ticket: Ticket
    dispatched_at: float
    expected_output: float  # tokens it is expected to generate in this dispatch
    others_at_dispatch: int  # sequences already running when it was dispatched
    generated: int = 0  # tokens it generated in this dispatch, as the shell reported them
    first_token_at: float | None = None
    preempting: bool = False  # named to stop, not yet requeued

    def resume_cost(self, block_size: int) -> int:
        """Tokens an engine with prefix caching computes again if this stops and resumes."""
        return (self.ticket.prompt_tokens + self.generated) % block_size


class Seats:
    """The running tickets by request id, counted in sequences (a request with n choices runs
    n), by class and in all."""

    def __init__(self, ledger: BudgetLedger, slots: AdapterSlots) -> None:
        self.ledger = ledger
        self.slots = slots
        self.running: dict[str, Running] = {}
        self.output_left = 0.0  # expected output tokens minus generated, of all running
        self.per_class = dict.fromkeys(TrafficClass, 0)  # sequences, not requests
        self.sequences = 0  # of both classes
        self.preempting = 0  # running tickets named to stop, not yet requeued

    def fits(self, ticket: Ticket, *, bulk_waiting: bool) -> bool:
        """Whether `ticket` may take a seat now: its budgets, and its adapter's slot."""
        return self.ledger.fits(ticket, bulk_waiting=bulk_waiting) and self.slots.fits(ticket)

    def take(self, ticket: Ticket, now: float, expected_output: float) -> None:
        self.ledger.acquire(ticket)
        self.slots.acquire(ticket)
        self.running[ticket.request_id] = Running(
            ticket, now, expected_output, others_at_dispatch=self.sequences
        )
        self.output_left += expected_output
        self.per_class[ticket.traffic_class] += ticket.n
        self.sequences += ticket.n

    def leave(self, entry: Running) -> None:
        del self.running[entry.ticket.request_id]
        self.output_left -= entry.expected_output - entry.generated
        if not self.running:
            self.output_left = 0.0  # no rounding drift survives an idle engine
        self.per_class[entry.ticket.traffic_class] -= entry.ticket.n
        self.sequences -= entry.ticket.n
        if entry.preempting:
            self.preempting -= 1
        self.ledger.release(entry.ticket)
        self.slots.release(entry.ticket)

    def stop(self, entry: Running) -> None:
        """Name `entry` to stop: it keeps its seat until the shell requeues it."""
        entry.preempting = True
        self.preempting += 1

    def chats(self) -> int:
        """Interactive sequences running."""
        return self.per_class[INTERACTIVE]

    def bulk(self) -> int:
        """Bulk sequences running and not named to stop."""
        return self.per_class[BULK] - self.preempting

    def tickets(self) -> list[Ticket]:
        return [e.ticket for e in self.running.values()]

    def is_idle(self) -> bool:
        return not self.running and self.ledger.is_idle()
