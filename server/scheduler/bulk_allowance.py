"""What bulk may do now: how many bulk sequences may run, and whether bulk's head may start.

The cap is the step-time model's (`bulk_cap.py`), corrected by the bulk controller
(`controller.py`), which this lets steer once a period by what chats measured where the server
wrote their tokens (`attainment.py`, fed by the shells). It is the chats' cap while chats run
or wait, and for `slo.bulk_hold_s` after the last one (longer while chats still arrive more
often than that); the idle cap (the knee) otherwise. A bulk start must also fit bulk's budgets
(within bulk's floor while a chat waits) and the prefill the step-time target leaves room for
(`PrefillPacer`), so that bulk resuming after a chat, or filling an idle engine, does not pile
its prefills into one long step that a chat arriving then would wait behind.

Chats' first tokens teach the estimates (the prefill rate, the idle time to first token) and
the controller's pace: whether a chat's first token came late behind bulk's prefills.
"""

from __future__ import annotations

import math

from server.scheduler.attainment import ChatMeter
from server.scheduler.budgets import BudgetLimits
from server.scheduler.bulk_cap import BulkCap, PrefillPacer
from server.scheduler.controller import BulkController
from server.scheduler.estimates import NEARLY_IDLE_OTHERS, AdapterCost, RateEstimates
from server.scheduler.queues import ClassQueues
from server.scheduler.seats import Running, Seats
from server.scheduler.targets import Targets
from server.scheduler.types import BULK, INTERACTIVE, Ticket

# Bulk may start this many times as often as the bulk allowed turns over (`_start_share`).
TURNOVER_PACE = 2.0
# Under feedback, chats beyond this many more than usually run together are a burst: each
# one more stops a bulk sequence until the burst has passed (`burst`).
BURST_MARGIN = 1
# Of a chat's TTFT target: a first token later than this after its dispatch waited in the
# engine, where bulk's prefills and steps are (the rest is the frontend's, or a queue's).
ENGINE_SHARE = 0.5


class BulkAllowance:
    def __init__(
        self,
        hold_s: float,
        limits: BudgetLimits,
        seats: Seats,
        queues: ClassQueues,
        estimates: RateEstimates,
        controller: BulkController,
        bulk_cap: BulkCap,
        meter: ChatMeter,
        targets: Targets,
    ) -> None:
        self._hold_s = hold_s  # `slo.bulk_hold_s`
        self._limits = limits
        self._seats = seats
        self._queues = queues
        self._estimates = estimates
        self._controller = controller
        self._bulk_cap = bulk_cap
        self._meter = meter
        self._targets = targets
        self._chats_quiet_since: float | None = -math.inf  # None while chats run or wait
        self._chats_on: dict[str | None, int] = {}  # chats about, by adapter (None: the base)
        self._chat_adapters: frozenset[str] = frozenset()  # what `_judge` last budgeted for
        self._pacer = PrefillPacer()  # bulk prefill per engine step
        self._prefill_until = -math.inf  # when the last bulk prefill started should end

    # --- chats about ---------------------------------------------------------------------
    def chats(self) -> int:
        """Interactive sequences running, and requests waiting."""
        return self._seats.per_class[INTERACTIVE] + len(self._queues.interactive)

    def chat_came(self, chat: Ticket, now: float) -> None:
        """`chat` was admitted: it waits, then runs, until `chat_went`."""
        on = self._chats_on
        on[chat.adapter] = on.get(chat.adapter, 0) + 1
        self._judge()
        self._chats_changed(now)

    def chat_went(self, chat: Ticket, now: float) -> None:
        """`chat` ended, running or queued."""
        on = self._chats_on
        left = on[chat.adapter] - 1
        if left:
            on[chat.adapter] = left
        else:
            del on[chat.adapter]
            self._judge()
        self._chats_changed(now)

    def _judge(self) -> None:
        """The cap budgets for the tightest targets of the chats about (each adapter's ratio
        least over them), and the slots keep room for their adapters (`slots_kept`); after
        the last one leaves, for theirs still: the bulk hold is for chats like them."""
        if not self._chats_on:
            return
        self._chat_adapters = frozenset(a for a in self._chats_on if a is not None)
        costs = [self._estimates.adapter_cost(adapter) for adapter in self._chats_on]
        step = min(cost.step for cost in costs)
        ttft = min(cost.ttft for cost in costs)
        self._bulk_cap.judge_for(AdapterCost(step, ttft) if len(costs) > 1 else costs[0])

    def _chats_changed(self, now: float) -> None:
        chats = self.chats()
        self._estimates.chats_changed(chats, now)
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
        hold = self._hold_s
        return max(quiet + hold, self._estimates.chats_rarer_than(hold))

    def _chats_about(self, now: float, hold_until: float | None) -> bool:
        """Chats run or wait, or the bulk hold after the last one (`_hold_until`) has not
        ended."""
        return hold_until is None or now < hold_until

    def slots_kept(self, now: float) -> frozenset[str]:
        """The LoRA adapters whose slots bulk leaves free while chats are about (`_judge`'s):
        a chat that finds its adapter's slot taken waits for the bulk on it to be stopped,
        and the bulk stopped loses what it had generated since its last full KV block. Under
        a steady stream of chats on an adapter, its slot empties between two of them often;
        bulk that took it would be stopped for the next."""
        if not self._chat_adapters or not self._chats_about(now, self._hold_until()):
            return frozenset()
        return self._chat_adapters

    # --- the cap -------------------------------------------------------------------------
    def allowed(self, now: float) -> int:
        """Bulk sequences that may run now: capped while chats are about, the idle cap (the
        knee) otherwise. The model's cap leaves room for the chats there are (at least one)
        and for as many more as usually arrive while one runs, so that chats arriving together
        start within their gap target with nothing to preempt. Under feedback it leaves room
        for as many as usually run (at least one): the gaps it steers by are what chats got as
        they came and went, and a bulk request outlives many chats, so a cap that followed
        each would only ratchet up to its highest (bulk fills the cap at once, and leaves it
        only as it ends)."""
        return self._allowed(self._chats_about(now, self._hold_until()))

    def _allowed(self, chats_about: bool) -> int:
        """`allowed`, with whether chats are about already read (a decision reads it once)."""
        if chats_about:
            expected = round(self._estimates.chats_together)
            if self._controller.enabled:
                return self._bulk_cap.with_chats(max(1, expected) + self.burst())
            return self._bulk_cap.with_chats(max(1, self.chats()) + expected)
        return self._bulk_cap.idle()

    def burst(self) -> int:
        """Chats running or waiting beyond `BURST_MARGIN` more than usually run together.
        The controller's scale holds for the chats there usually are; Poisson arrivals bunch,
        and a step over twice as many chats as usual is longer by their sequences, for every
        chat in it: those of a burst miss together. Each chat of a burst leaves room for
        itself, by a bulk sequence stopped (resumed from the prefix cache, where the engine
        keeps one, once the burst has passed)."""
        usual = self._estimates.chats_together
        return max(0, self.chats() - max(1, round(usual)) - BURST_MARGIN)

    def steer(self, now: float) -> None:
        """The bulk controller's period, if one is due: it may grow bulk only while bulk waits
        at a cap the scale sets (not the knee's or the budgets'), and shrink it only while bulk
        runs above its floor and no more than the cap allows (a cap below what runs already is
        waiting for bulk to end, or to be preempted)."""
        controller = self._controller
        if not controller.due(now):
            return
        running = self._seats.bulk()
        allowed = self.allowed(now)
        waiting = len(self._queues.bulk) > 0
        chats = max(1, round(self._estimates.chats_together))
        controller.steer(
            now,
            self._meter,
            may_grow=running >= allowed and waiting and self._bulk_cap.scaled(chats),
            may_shrink=self._bulk_cap.floor() < running <= allowed,
            bulk_about=running > 0 or waiting,
        )

    # --- starts --------------------------------------------------------------------------
    def start(self, ticket: Ticket, chat_head: Ticket | None, now: float, allowed: int) -> bool:
        """Whether bulk's `ticket` may start now: below the cap (`allowed`: `allowed(now)`,
        which the poll has read), within the prefill the step-time target leaves room for, and
        within bulk's budgets (its floor, while the chat `chat_head` waits). If it may, it
        starts: its prefill takes its share of the pacer's bucket. (One call, so that whether
        chats are about is read once for both.)"""
        if self._seats.bulk() >= allowed:
            return False
        chats_about = self._chats_about(now, self._hold_until())
        share = self._start_share(ticket, chats_about, allowed)
        needs = self._pacing(ticket, now, chats_about, share)
        if needs is not None and not self._pacer.allows(*needs):
            return False
        ledger = self._seats.ledger
        if chat_head is None:
            if not ledger.fits(ticket, bulk_waiting=True):
                return False
        elif not ledger.fits_bulk_floor(ticket):
            return False
        prefill_s = self.prefill_s(ticket)
        self._pacer.spend(prefill_s, share, self._limits.prefill_steps(ticket))
        self._prefill_until = max(self._prefill_until, now + prefill_s)
        return True

    def _pacing(
        self, ticket: Ticket, now: float, chats_about: bool, share: float
    ) -> tuple[float, float] | None:
        """What the pacer must hold for `ticket` to start: (prefill seconds, least share of
        the bucket: `share`); None: it starts at once. Below bulk's floor a start is not paced,
        unless the controller has slowed the pace (first tokens late behind bulk's prefills):
        then it waits for the bucket to refill what the last start took, and no more."""
        below_floor = self._seats.bulk() < self._bulk_cap.floor()
        if below_floor and self._controller.pace >= 1.0:
            return None
        self._pace(now, chats_about)
        if below_floor:
            return 0.0, 0.0
        return self.prefill_s(ticket), share

    def _start_share(self, ticket: Ticket, chats_about: bool, allowed: int) -> float:
        """The least share of a step's prefill headroom one bulk start takes while chats are
        about, whatever its prefill: one start per engine step, or more where the bulk allowed
        turns over faster (`TURNOVER_PACE` times the rate that replaces it, with each request's
        expected output as its steps). Bulk started together ends together (closed-loop
        clients, a batch's lines: the same lengths), and a cohort that returns at once brings
        every start's prefill, and the server's own work on each request, into the same few
        steps, where a chat arriving waits behind them. Spread once, the starts stay spread:
        each follows the end of the one it replaces. Within bulk's guaranteed minimum share
        a start takes none."""
        if not chats_about or self._seats.ledger.fits_bulk_floor(ticket):
            return 0.0
        turnover_steps = max(1.0, self._estimates.expected_output_tokens(ticket))
        return min(1.0, turnover_steps / (TURNOVER_PACE * max(1, allowed)))

    def _pace(self, now: float, chats_about: bool) -> None:
        step = self._estimates.step_s(self._seats.sequences + 1)
        headroom = self._bulk_cap.prefill_headroom(step, chats_about=chats_about)
        self._pacer.update(now, headroom, step, self._controller.pace)

    def prefill_s(self, ticket: Ticket) -> float:
        """Engine seconds to prefill `ticket`."""
        return self._limits.prefill_tokens(ticket) / self._estimates.prefill_tokens_per_s

    def wake_times(self, now: float, allowed: int | None) -> list[float]:
        """When what bulk may do changes by itself: the controller's next period (while bulk
        runs and chats' gaps are measured), and while bulk waits below what it may grow to,
        the next paced start and the end of the bulk hold. `allowed`: `allowed(now)`, if the
        poll has read it."""
        times: list[float] = []
        controller = self._controller
        if controller.enabled and self._seats.per_class[BULK] and self._meter.has_gaps:
            times.append(max(now, controller.next_at))
        bulk_head = self._queues.bulk.peek()
        if bulk_head is not None:
            running = self._seats.bulk()
            hold_until = self._hold_until()
            chats_about = self._chats_about(now, hold_until)
            if allowed is None:
                allowed = self._allowed(chats_about)
            if running < allowed:
                share = self._start_share(bulk_head, chats_about, allowed)
                needs = self._pacing(bulk_head, now, chats_about, share)
                ready = now if needs is None else self._pacer.ready_at(*needs)
                if ready > now:  # else the budgets hold it, and a release will poll
                    times.append(ready)
            if hold_until is not None and now < hold_until and running < self._bulk_cap.idle():
                times.append(hold_until)
        return times

    # --- first tokens --------------------------------------------------------------------
    def first_token(self, entry: Running, now: float) -> None:
        """A running ticket's first token, at `now`: what it says of the prefill rate, of the
        idle time to first token, and (a chat's) of the pace of bulk's starts."""
        entry.first_token_at = now
        ticket = entry.ticket
        estimates = self._estimates
        if not ticket.resumed_tokens:  # a continuation's prefix is mostly cached
            estimates.observe_prefill(
                ticket.prompt_tokens, now - entry.dispatched_at, entry.others_at_dispatch
            )
        if ticket.traffic_class is INTERACTIVE:
            if entry.others_at_dispatch <= NEARLY_IDLE_OTHERS:
                estimates.observe_engine_ttft(now - entry.dispatched_at, ticket.adapter)
            if self._controller.enabled:
                self._controller.first_token(late=self._late_behind_bulk(entry, now))

    def _late_behind_bulk(self, entry: Running, now: float) -> bool:
        """Whether a chat's first token came late behind bulk's prefills: past its TTFT target,
        more than `ENGINE_SHARE` of it after its dispatch (where bulk's prefills and steps are
        what it waits behind), and with a bulk prefill (as predicted from its start) under way
        while it waited in the engine, or as long before its dispatch (in the step it joined).
        Judged where the scheduler sees the token, the frontend's writing of it aside."""
        targets = self._targets.of(entry.ticket)
        if targets is None:
            return False
        in_engine = now - entry.dispatched_at
        return (
            now - entry.ticket.arrival > targets.ttft_s
            and in_engine > ENGINE_SHARE * targets.ttft_s
            and self._prefill_until >= entry.dispatched_at - in_engine
        )
