"""The asyncio shell around `BatchDispatcher`: wall-clock workers running a batch engine.

The core decides; this module turns its decisions into asyncio: one task per running batch,
one timer for the next batching or lease deadline, futures for each waiting request (one for
dispatch, one for the result), and metrics recorded at every state change. A worker whose
batch crashes is reported to the core, which retries or fails the members; the worker comes
back after `restart_s`. Results resolve a waiter only if the core says the attempt is current.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from engine_adapters.protocol import EngineError, GenerationRequest, TokenDelta
from engine_adapters.sim_batch import BatchItem, BatchItemResult
from server.core.errors import (
    DeadlineExceeded,
    EngineUnavailable,
    GenerationFailed,
    SluiceError,
)
from server.fixed_batch.decisions import BatchConfig, BatchOutcome, BatchStep, Dispatch, Ended
from server.fixed_batch.dispatcher import BatchDispatcher
from server.observability.metrics import Metrics
from server.scheduler.attainment import SloWatch
from server.scheduler.refusals import refusal_error
from server.scheduler.types import Admission, RejectReason, Ticket, TrafficClass
from server.scheduler.wakeup import WakeupTimer


class BatchEngine(Protocol):
    """What the batch runtime needs from a fixed-time batch engine."""

    async def run_batch(
        self, worker_id: int, items: Sequence[BatchItem]
    ) -> Sequence[BatchItemResult]: ...


def rejection_error(reason: RejectReason, ticket: Ticket) -> SluiceError:
    messages = {
        RejectReason.OVERLOADED: "the queue for this model is full; retry later",
        RejectReason.DEADLINE_UNMEETABLE: "the deadline cannot be met even if the request "
        "is dispatched when the next worker frees up",
        RejectReason.NO_COMPATIBLE_WORKER: f"no worker serves model {ticket.model!r}",
        RejectReason.DUPLICATE_ID: f"request id {ticket.request_id!r} is already in flight",
    }
    return refusal_error(reason, messages[reason])


@dataclass(eq=False)
class _Waiter:
    request: GenerationRequest
    dispatched: asyncio.Future[float]
    result: asyncio.Future[BatchItemResult] = field(init=False)

    def __post_init__(self) -> None:
        self.result = self.dispatched.get_loop().create_future()
        # A caller may leave without reading its result; do not warn about that.
        self.result.add_done_callback(lambda f: f.cancelled() or f.exception())

    def fail(self, error: SluiceError) -> None:
        future = self.result if self.dispatched.done() else self.dispatched
        if not future.done():
            future.set_exception(error)


class BatchGeneration:
    """One dispatched request: a single delta with the whole response once its batch ends."""

    def __init__(
        self, ticket: Ticket, waiter: _Waiter, dispatched_at: float, clock: Callable[[], float]
    ) -> None:
        self._ticket = ticket
        self._waiter = waiter
        self._dispatched_at = dispatched_at
        self._clock = clock
        self.completed = False
        self.preemptions = 0  # batch mode never preempts
        self.pauses: tuple[tuple[float, float | None], ...] = ()
        self.cached_tokens: int | None = None  # nor reads a prefix cache
        self.finish_reasons: list[str] = []

    @property
    def dispatched_at(self) -> float:
        return self._dispatched_at

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self._stream()

    async def _stream(self) -> AsyncGenerator[TokenDelta, None]:
        remaining = self._ticket.deadline - self._clock()
        try:
            async with asyncio.timeout(remaining if remaining != float("inf") else None):
                result = await asyncio.shield(self._waiter.result)
        except TimeoutError:
            raise DeadlineExceeded("the request's deadline passed while its batch ran") from None
        self.completed = True
        self.finish_reasons.append(result.finish_reason)
        yield TokenDelta(result.text, result.token_ids, finish_reason=result.finish_reason)


class BatchRuntime:
    """Implements `Dispatcher` for fixed-time batch engines."""

    def __init__(
        self,
        config: BatchConfig,
        engine: BatchEngine,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        restart_s: float = 0.0,
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        self.restart_s = restart_s
        self.core = BatchDispatcher(config)
        self._waiters: dict[str, _Waiter] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._timer = WakeupTimer(self._poll)
        self._stopping = True

    async def start(self) -> None:
        self._stopping = False
        self._record_state()

    async def stop(self) -> None:
        """Refuse queued and running requests, and stop the workers."""
        self._stopping = True
        self._timer.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for waiter in self._waiters.values():
            waiter.fail(EngineUnavailable("the server is shutting down"))

    def slo(self, ticket: Ticket) -> SloWatch | None:
        return None  # whole answers from fixed-time batches: no stream to pace

    def queued(self) -> int:
        return sum(self.core.queue_depth(model) for model in self.core.models)

    def adapter_loaded(self, name: str) -> None:
        pass  # (its engine serves no adapters)

    def generation(self, ticket: Ticket, request: GenerationRequest) -> Admission[BatchGeneration]:
        if self._stopping:
            raise EngineUnavailable("the batch runtime is not running")
        reason = self.core.submit(ticket, self.clock())
        if reason is not None:  # counted by the route, with every other refusal
            raise rejection_error(reason, ticket)
        waiter = _Waiter(request, asyncio.get_running_loop().create_future())
        self._waiters[ticket.request_id] = waiter
        self._poll()
        return Admission(partial(self._enter, ticket, waiter), partial(self._leave, ticket))

    async def _enter(self, ticket: Ticket, waiter: _Waiter) -> BatchGeneration:
        try:
            dispatched_at = await waiter.dispatched
        except BaseException:
            del waiter  # its failed future keeps the error, whose traceback holds this frame
            raise
        return BatchGeneration(ticket, waiter, dispatched_at, self.clock)

    async def _leave(self, ticket: Ticket, _: BatchGeneration | None) -> None:
        del self._waiters[ticket.request_id]
        self.core.cancel(ticket.request_id)  # no-op if it already ended
        if not self._stopping:
            self._poll()

    # --- applying decisions ---
    def _poll(self) -> None:
        self._act(self.core.poll(self.clock()))

    def _act(self, step: BatchStep) -> None:
        for dispatch in step.dispatches:
            self._start(dispatch)
        self._end(step.ended)
        for worker_id in step.lost_workers:  # lease ran out: replace the hung worker
            task = self._tasks.pop(worker_id, None)
            if task is not None:
                task.cancel()
            self.metrics.worker_failures.labels(model=self.config.workers[worker_id]).inc()
            self._restart_later(worker_id)
        for ticket in step.retried:
            self.metrics.batch_retries.labels(model=ticket.model).inc()
        self._arm_timer()
        self._record_state()

    def _start(self, dispatch: Dispatch) -> None:
        self.metrics.batch_size.labels(model=dispatch.model).observe(len(dispatch.tickets))
        items = []
        for ticket in dispatch.tickets:
            waiter = self._waiters[ticket.request_id]
            if not waiter.dispatched.done():
                waiter.dispatched.set_result(dispatch.started)
            req = waiter.request
            items.append(
                BatchItem(
                    ticket.request_id,
                    dispatch.attempt_id,
                    req.prompt_token_ids,
                    req.sampling.max_tokens,
                )
            )
        task = asyncio.get_running_loop().create_task(self._run(dispatch, items))
        self._tasks[dispatch.worker_id] = task

    async def _run(self, dispatch: Dispatch, items: list[BatchItem]) -> None:
        try:
            results = await self.engine.run_batch(dispatch.worker_id, items)
        except EngineError:
            if self._tasks.get(dispatch.worker_id) is asyncio.current_task():
                del self._tasks[dispatch.worker_id]
                self._lose_worker(dispatch.worker_id)
            return
        if self._tasks.get(dispatch.worker_id) is asyncio.current_task():
            del self._tasks[dispatch.worker_id]
        by_id = {r.request_id: r for r in results}
        done = self.core.complete_batch(
            dispatch.lease_id, [(r.request_id, r.attempt_id) for r in results], self.clock()
        )
        for ticket in done.delivered:
            waiter = self._waiters.get(ticket.request_id)
            if waiter is not None and not waiter.result.done():
                waiter.result.set_result(by_id[ticket.request_id])
        if not self._stopping:
            self._poll()

    def _lose_worker(self, worker_id: int) -> None:
        model = self.config.workers[worker_id]
        outcome = self.core.on_worker_failure(worker_id, self.clock())
        if outcome.lease_id is not None:
            self.metrics.worker_failures.labels(model=model).inc()
            self.metrics.batch_retries.labels(model=model).inc(len(outcome.retried))
        self._end(outcome.ended)
        self._restart_later(worker_id)
        self._poll()

    def _restart_later(self, worker_id: int) -> None:
        def restart() -> None:
            if not self._stopping:
                self.core.worker_up(worker_id)
                self._poll()

        asyncio.get_running_loop().call_later(self.restart_s, restart)

    def _end(self, ended: list[Ended]) -> None:
        for item in ended:
            ticket = item.ticket
            waiter = self._waiters.get(ticket.request_id)
            if item.outcome == BatchOutcome.EXPIRED:
                error: SluiceError = DeadlineExceeded(f"request expired: {item.reason}")
            else:
                error = GenerationFailed(f"request failed: {item.reason}")
            if waiter is not None:
                waiter.fail(error)

    def _arm_timer(self) -> None:
        if not self._stopping:
            self._timer.arm(self.core.next_timer(), self.clock())

    def _record_state(self) -> None:
        core, now = self.core, self.clock()
        for model in core.models:
            oldest = core.oldest_queued_arrival(model)
            age = 0.0 if oldest is None else max(0.0, now - oldest)
            for tc in TrafficClass:
                labels = {"model": model, "traffic_class": tc.value}
                depth = core.queue_depth_by_class(model, tc)
                self.metrics.queue_depth.labels(**labels).set(depth)
                self.metrics.queue_oldest_age.labels(**labels).set(age if depth else 0.0)
