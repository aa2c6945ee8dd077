"""The discrete-event shell: the batch dispatcher against the `sim-batch` model, virtual time.

Arrivals are pulled lazily, one pending event at a time, so a million requests need no more
than a handful of events in the heap. Failures are injected here: a batch with a poison prompt
crashes its worker partway, `kills` end a worker's batch at a given time, `hangs` make a
worker's batch answer only after its lease has run out (a late answer the core must discard),
and `fail_rate` crashes batches at a seeded random rate. A lost worker restarts after
`restart_s`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

from engine_adapters.sim_batch import BatchModel
from server.fixed_batch.decisions import BatchConfig, BatchOutcome, BatchStep, Dispatch, Ended
from server.fixed_batch.dispatcher import BatchDispatcher
from server.scheduler.types import Ticket
from server.simulation.events import EventHandle, EventLoop
from server.simulation.workload import Arrival


@dataclass(frozen=True, slots=True)
class Faults:
    """Failure injection for a simulated run. Times in seconds of virtual time."""

    kills: tuple[tuple[int, float], ...] = ()  # (worker, time): the worker dies then
    hangs: tuple[tuple[int, float], ...] = ()  # (worker, time): its next batch answers late
    hang_s: float = 1.0  # how late a hung batch answers, after its start
    cancels: tuple[tuple[str, float], ...] = ()  # (request id, time): the caller leaves
    fail_rate: float = 0.0  # probability that any batch crashes its worker
    restart_s: float = 0.0  # how long a lost worker takes to come back
    seed: int = 0


@dataclass(slots=True)
class RequestRecord:
    id: str
    arrival: float
    deadline: float | None
    dispatch: float | None = None
    finish: float | None = None
    ended: float | None = None
    outcome: str | None = None
    worker: int | None = None
    attempts: int = 0
    reason: str | None = None


@dataclass(slots=True)
class BatchRecord:
    lease_id: int
    worker: int
    size: int
    start: float
    end: float | None = None
    status: str = "running"  # completed | crashed | lost | running
    retry: bool = False


@dataclass(slots=True)
class SimResult:
    requests: list[RequestRecord]
    batches: list[BatchRecord] = field(default_factory=list)
    batch_sizes: int = 0
    batch_count: int = 0
    discarded_results: int = 0
    duplicate_deliveries: int = 0
    end_time: float = 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.batch_sizes / self.batch_count if self.batch_count else 0.0


class BatchSimulation:
    def __init__(
        self,
        config: BatchConfig,
        *,
        model: BatchModel | None = None,
        faults: Faults | None = None,
        keep_batches: bool = True,
    ) -> None:
        self.config = config
        self.model = model or BatchModel(config.batch_time_s, config.max_batch)
        self.faults = faults or Faults()
        self.core = BatchDispatcher(config)
        self.loop = EventLoop()
        self._rng = random.Random(self.faults.seed)
        self._keep_batches = keep_batches
        self._records: dict[str, RequestRecord] = {}
        self._poison: set[str] = set()
        self._hung: set[int] = set()
        self._running: dict[int, tuple[int, EventHandle]] = {}  # worker -> (lease, answer)
        self._batches: dict[int, BatchRecord] = {}
        self._timer: EventHandle | None = None
        self._timer_at: float | None = None
        self._arrivals: Iterator[Arrival] = iter(())
        self._result = SimResult([])

    def run(self, arrivals: Iterable[Arrival]) -> SimResult:
        loop = self.loop
        for worker, at in self.faults.kills:
            loop.call_at(at, partial(self._kill, worker))
        for worker, at in self.faults.hangs:
            loop.call_at(at, partial(self._hung.add, worker))
        for request_id, at in self.faults.cancels:
            loop.call_at(at, partial(self._cancel, request_id))
        self._arrivals = iter(arrivals)
        self._schedule_next_arrival()
        loop.run()
        self._result.requests = list(self._records.values())
        self._result.end_time = loop.now
        return self._result

    # --- events ---
    def _schedule_next_arrival(self) -> None:
        arrival = next(self._arrivals, None)
        if arrival is not None:
            self.loop.call_at(arrival.time_s, lambda: self._arrive(arrival))

    def _arrive(self, arrival: Arrival) -> None:
        now = self.loop.now
        deadline = arrival.deadline_s
        record = RequestRecord(arrival.id, arrival.time_s, deadline)
        self._records[arrival.id] = record
        if arrival.prompt and self.model.is_poison_text(arrival.prompt):
            self._poison.add(arrival.id)
        ticket = Ticket(
            arrival.id,
            arrival.tenant,
            arrival.traffic_class,
            arrival.model,
            arrival.time_s,
            math.inf if deadline is None else deadline,
            arrival.prompt_tokens,
            arrival.max_tokens,
        )
        reason = self.core.submit(ticket, now)
        if reason is not None:
            record.outcome, record.ended, record.reason = BatchOutcome.REJECTED, now, str(reason)
        else:
            self._act(self.core.poll(now))
        self._schedule_next_arrival()

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self._act(self.core.poll(self.loop.now))

    def _answer(self, dispatch: Dispatch) -> None:
        now = self.loop.now
        running = self._running.get(dispatch.worker_id)
        if running is not None and running[0] == dispatch.lease_id:
            del self._running[dispatch.worker_id]
        attempt = dispatch.lease_id
        done = self.core.complete_batch(
            attempt, [(t.request_id, attempt) for t in dispatch.tickets], now
        )
        records = self._records
        for ticket in done.delivered:
            record = records[ticket.request_id]
            if record.outcome is not None:
                self._result.duplicate_deliveries += 1
            record.finish = record.ended = now
            record.outcome = BatchOutcome.COMPLETED
            record.worker = dispatch.worker_id
        self._result.discarded_results += len(done.discarded)
        self._close_batch(dispatch.lease_id, now, "completed" if done.worker_freed else "late")
        self._act(self.core.poll(now))

    def _cancel(self, request_id: str) -> None:
        if self.core.cancel(request_id) is not None:
            record = self._records[request_id]
            record.outcome, record.ended = BatchOutcome.CANCELLED, self.loop.now
            self._act(self.core.poll(self.loop.now))

    def _crash(self, dispatch: Dispatch) -> None:
        self._running.pop(dispatch.worker_id, None)
        self._lose_worker(dispatch.worker_id)

    def _kill(self, worker: int) -> None:
        running = self._running.pop(worker, None)
        if running is not None:
            running[1].cancel()
        self._lose_worker(worker)

    def _lose_worker(self, worker: int) -> None:
        now = self.loop.now
        outcome = self.core.on_worker_failure(worker, now)
        if outcome.lease_id is not None:
            self._close_batch(outcome.lease_id, now, "crashed")
        self._end(outcome.ended, now)
        self._restart_later(worker)
        self._act(self.core.poll(now))

    def _restart_later(self, worker: int) -> None:
        def restart() -> None:
            self.core.worker_up(worker)
            self._act(self.core.poll(self.loop.now))

        self.loop.call_later(self.faults.restart_s, restart)

    # --- acting on decisions ---
    def _act(self, step: BatchStep) -> None:
        now = self.loop.now
        if step.dispatches:
            for dispatch in step.dispatches:
                self._start(dispatch, now)
        if step.ended:
            self._end(step.ended, now)
        for worker in step.lost_workers:
            self._running.pop(worker, None)  # its answer, if any, comes late and is fenced
            self._restart_later(worker)
        when = self.core.next_timer()
        if when != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = None if when is None else self.loop.call_at(when, self._on_timer)

    def _start(self, dispatch: Dispatch, now: float) -> None:
        records = self._records
        worker = dispatch.worker_id
        for ticket in dispatch.tickets:
            record = records[ticket.request_id]
            if record.dispatch is None:
                record.dispatch = now
            record.worker = worker
            record.attempts += 1
        result = self._result
        result.batch_count += 1
        result.batch_sizes += len(dispatch.tickets)
        if self._keep_batches:
            batch = BatchRecord(
                dispatch.lease_id, worker, len(dispatch.tickets), now, retry=dispatch.retry
            )
            result.batches.append(batch)
            self._batches[dispatch.lease_id] = batch
        poison = self._poison
        crash = bool(poison) and any(t.request_id in poison for t in dispatch.tickets)
        faults = self.faults
        if not crash and faults.fail_rate and self._rng.random() < faults.fail_rate:
            crash = True
        if crash:
            crash_at = now + self.model.crash_after_s()
            handle = self.loop.call_at(crash_at, lambda: self._crash(dispatch))
        elif worker in self._hung:
            self._hung.discard(worker)
            handle = self.loop.call_at(now + faults.hang_s, lambda: self._answer(dispatch))
        else:
            handle = self.loop.call_at(dispatch.expected_finish, lambda: self._answer(dispatch))
        self._running[worker] = (dispatch.lease_id, handle)

    def _end(self, ended: list[Ended], now: float) -> None:
        for item in ended:
            record = self._records[item.ticket.request_id]
            record.outcome, record.ended, record.reason = item.outcome, now, item.reason

    def _close_batch(self, lease_id: int, now: float, status: str) -> None:
        batch = self._batches.get(lease_id)
        if batch is not None and batch.end is None:
            batch.end, batch.status = now, status


def simulate(
    config: BatchConfig,
    arrivals: Iterable[Arrival],
    *,
    faults: Faults | None = None,
    model: BatchModel | None = None,
    keep_batches: bool = True,
) -> SimResult:
    return BatchSimulation(config, model=model, faults=faults, keep_batches=keep_batches).run(
        arrivals
    )
