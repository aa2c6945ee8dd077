"""The asyncio shell around `SchedulerCore`: futures for queued requests, one expiry timer,
deadlines on running streams, gauges recorded at every state change.

The core decides; this module only turns decisions into asyncio events (resolving a waiter's
future, failing it with DeadlineExceeded) and calls the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial

from engine_adapters.protocol import EngineClient, GenerationRequest, TokenDelta
from server.core.config import SluiceConfig
from server.core.errors import DeadlineExceeded, EngineUnavailable
from server.observability.metrics import ClassGauges, Metrics
from server.scheduler.attainment import SloWatch
from server.scheduler.budgets import BudgetLimits
from server.scheduler.calibration import Calibration, calibrate, calibrate_adapter
from server.scheduler.core import Rejected, SchedulerCore
from server.scheduler.refusals import refusal_error
from server.scheduler.types import Admission, PreemptCause, Ticket, TrafficClass
from server.scheduler.wakeup import WakeupTimer


class RunningGeneration:
    """A dispatched ticket's stream: engine deltas until the end or the deadline.

    If the scheduler preempts it (bulk making room for a chat), the engine request is aborted,
    the ticket waits in the queue again, and the stream resumes with a new engine request whose
    prompt is the original prompt plus every token generated so far: the consumer sees one
    uninterrupted stream. (A stop string spanning the resumption point is not detected.)
    """

    def __init__(
        self,
        runtime: SchedulerRuntime,
        ticket: Ticket,
        request: GenerationRequest,
        dispatched_at: float,
    ) -> None:
        self._runtime = runtime
        self._ticket = ticket
        self._request = request
        self._dispatched_at = dispatched_at
        self.output_tokens = 0  # across every engine request of this generation
        self.completed = False  # every choice finished
        self._choices_left = request.sampling.n
        self.preemptions = 0
        # Each preemption: (when it was stopped, when it was dispatched again; None: not yet).
        self.pauses: list[tuple[float, float | None]] = []
        # Prompt tokens the engine found cached: the first engine request's that said (a
        # continuation's only if it was preempted, or taken over, before saying).
        self.cached_tokens: int | None = None
        self.finish_reasons: list[str] = []  # the engine's, of each choice as it finished
        # The tokens to resume from, kept only by what the scheduler may preempt (preemptible
        # bulk: one choice only); a chat keeps no token of its own here.
        self._generated: list[int] | None = (
            [] if ticket.traffic_class is TrafficClass.BULK and ticket.preemptible else None
        )
        self._stream_iter: AsyncGenerator[TokenDelta, None] | None = None
        self._task: asyncio.Task[object] | None = None
        self._waiting_on_engine = False
        self._deadline_passed = False
        self._preempt_requested = False

    @property
    def dispatched_at(self) -> float:
        return self._dispatched_at

    @property
    def tokens_kept(self) -> int:
        """Output token ids it holds to resume from: none unless it may be preempted."""
        return 0 if self._generated is None else len(self._generated)

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        if self._stream_iter is not None:
            raise RuntimeError("a generation can be iterated once")
        self._stream_iter = self._stream()
        return self._stream_iter

    async def aclose(self) -> None:
        """Stop the stream (and with it the engine request) if the consumer left it early."""
        if self._stream_iter is not None:
            await self._stream_iter.aclose()

    def preempt(self) -> None:
        """Stop the engine request at once (or at the next engine wait) and resume later."""
        self._preempt_requested = True
        self._interrupt_engine_wait()

    def _on_deadline(self) -> None:
        self._deadline_passed = True
        self._interrupt_engine_wait()

    def _interrupt_engine_wait(self) -> None:
        if self._waiting_on_engine and self._task is not None:
            self._task.cancel()

    async def _stream(self) -> AsyncGenerator[TokenDelta, None]:
        """Engine deltas, cut at the deadline by one timer per request (not one per token).

        The timer (or a preemption) only marks what happened; if the stream is then waiting on
        the engine it cancels that wait, which aborts the engine request. Time spent writing to
        the client is not interrupted here (the transport's send timeout bounds it).
        """
        runtime, ticket = self._runtime, self._ticket
        task = self._task = asyncio.current_task()
        assert task is not None
        timer = asyncio.get_running_loop().call_later(
            max(0.0, ticket.deadline - runtime.clock()), self._on_deadline
        )
        request = self._request
        try:
            while True:
                deltas = runtime.engine.generate(request)
                next_delta = deltas.__anext__
                try:
                    while not self._must_yield_engine():
                        if self._deadline_passed:
                            raise DeadlineExceeded("the request's deadline passed while generating")
                        # The wait on the engine, the one wait the timer interrupts (inline: a
                        # coroutine of its own per token costs a frame and a step).
                        self._waiting_on_engine = True
                        try:
                            delta = await next_delta()
                        except StopAsyncIteration:
                            break
                        except asyncio.CancelledError:
                            if not self._interrupted(task):
                                raise
                            break  # preempted (the deadline raised in `_interrupted`)
                        finally:
                            self._waiting_on_engine = False
                        self._count(delta, request)
                        yield delta
                finally:
                    await deltas.aclose()  # type: ignore[attr-defined]
                if not self._must_yield_engine():
                    return
                request = await self._resume()
        finally:
            timer.cancel()
            self._task = None  # the task may end keeping our error, whose traceback holds us
            del task

    def _must_yield_engine(self) -> bool:
        """Preempted, with tokens left to generate (a finished answer just ends)."""
        return self._preempt_requested and not self.completed

    def _interrupted(self, task: asyncio.Task[object]) -> bool:
        """Whether the cancellation of a wait on the engine was the deadline's or a
        preemption's alone (raising DeadlineExceeded for the deadline); False: the task itself
        is being cancelled."""
        if (self._deadline_passed or self._preempt_requested) and task.uncancel() == 0:
            if self._deadline_passed:
                raise DeadlineExceeded("the request's deadline passed while generating") from None
            return True
        return False

    def _count(self, delta: TokenDelta, request: GenerationRequest) -> None:
        cached = delta.num_cached_tokens  # (on an engine request's first delta only)
        if cached is not None:
            if request.resumed_tokens:
                self._runtime.resumed_prefill_tokens.inc(request.prompt_length - cached)
            if self.cached_tokens is None:  # the first engine request that said, within the
                # client's prompt (a continuation's prompt ends with the tokens it generated)
                self.cached_tokens = min(cached, request.prompt_length - request.resumed_tokens)
        if delta.token_ids:
            self._runtime.core.generated(
                self._ticket.request_id, len(delta.token_ids), self._runtime.clock()
            )
            self.output_tokens += len(delta.token_ids)
            if self._generated is not None:
                self._generated.extend(delta.token_ids)
        if delta.finish_reason is not None and delta.finish_reason != "abort":
            self.finish_reasons.append(delta.finish_reason)
            self._choices_left -= 1
            self.completed = self._choices_left == 0

    async def _resume(self) -> GenerationRequest:
        """Back to the queue as a continuation; the engine request that resumes the stream."""
        self._preempt_requested = False
        runtime = self._runtime
        stopped = runtime.clock()
        waiter = runtime.requeue(self._ticket.request_id)
        self.preemptions += 1
        self.pauses.append((stopped, None))
        try:
            self.pauses[-1] = (stopped, await waiter)
        finally:
            del waiter  # (see SchedulerRuntime._enter)
        assert self._generated is not None, "only preemptible bulk is preempted"
        return self._request.continued(
            self._generated, f"{self._request.request_id}~{self.preemptions}"
        )


class SchedulerRuntime:
    """Implements `Dispatcher` for continuous-batching engines."""

    def __init__(
        self,
        config: SluiceConfig,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.clock = clock
        # This model's children, looked up once (the others are labelled by budget).
        self.resumed_prefill_tokens = metrics.resumed_prefill_tokens.labels(model_name)
        self._preempted = metrics.engine_aborts.labels(model_name, "preempted")
        self._class_gauges = [
            (tc, ClassGauges.bind(metrics, model_name, tc.value)) for tc in TrafficClass
        ]
        self._bulk_cap = metrics.bulk_cap.labels(model_name)
        self._knee = metrics.knee.labels(model_name)
        self._core: SchedulerCore | None = None
        self._waiters: dict[str, asyncio.Future[float]] = {}
        self._running: dict[str, RunningGeneration] = {}
        self._preempt_on_start: set[str] = set()  # preempted before its stream object existed
        self._timer = WakeupTimer(self._dispatch)
        self._stopping = False
        self.calibration: Calibration | None = None
        # The adapters loaded at runtime being timed (`adapter_loaded`), until each is.
        self.adapter_calibrations: set[asyncio.Task[None]] = set()
        self._calibration_lock = asyncio.Lock()  # one adapter's runs at a time

    @property
    def core(self) -> SchedulerCore:
        if self._core is None:
            raise RuntimeError("SchedulerRuntime.start() has not run")
        return self._core

    async def start(self) -> None:
        """Size the budgets from the engine's limits (the engine must have started)."""
        limits = BudgetLimits.from_engine(self.config.budgets, self.engine.model)
        self._core = SchedulerCore(self.config, limits)
        self._stopping = False
        if self.config.estimates.calibrate:
            self.calibration = await calibrate(
                self.engine, self._core.estimates, max_sequences=limits.sequences, clock=self.clock
            )
        for name, limit in self._core.ledger.limits_by_name().items():
            self.metrics.budget_limit.labels(budget=name).set(limit)
        self._gauges_read_at_scrape(self._core)

    async def stop(self) -> None:
        """Refuse queued requests; running streams end with their engine requests."""
        self._stopping = True
        self._timer.cancel()
        for task in list(self.adapter_calibrations):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(EngineUnavailable("the server is shutting down"))
        self._waiters.clear()

    def adapter_loaded(self, name: str) -> None:
        """The LoRA adapter `name` was loaded at runtime: its targets are exported, and with
        calibration on it is timed against the base model in the background (its chats keep
        the base model's targets until then)."""
        self._export_targets(self.core, name)
        if not self.config.estimates.calibrate or self._stopping:
            return
        task = asyncio.create_task(self._calibrate_adapter(name), name=f"calibrate-{name}")
        self.adapter_calibrations.add(task)
        task.add_done_callback(self.adapter_calibrations.discard)

    async def _calibrate_adapter(self, name: str) -> None:
        async with self._calibration_lock:
            await calibrate_adapter(self.engine, self.core.estimates, name, clock=self.clock)

    def slo(self, ticket: Ticket) -> SloWatch | None:
        core = self.core
        targets = core.targets_for(ticket)
        if targets is None:
            return None
        steered = ticket.traffic_class is TrafficClass.INTERACTIVE and core.controller.enabled
        return SloWatch(targets, core.meter if steered else None)

    def queued(self) -> int:
        core = self.core
        return sum(core.queue_depth(tc) for tc in TrafficClass)

    def generation(
        self, ticket: Ticket, request: GenerationRequest
    ) -> Admission[RunningGeneration]:
        if self._stopping:
            raise EngineUnavailable("the server is shutting down")
        decision = self.core.submit(ticket, self.clock())
        if isinstance(decision, Rejected):
            raise refusal_error(decision.reason, decision.message, decision.retry_after)
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = waiter
        self._dispatch()
        return Admission(
            partial(self._enter, ticket, request, waiter), partial(self._leave, ticket)
        )

    async def _enter(
        self, ticket: Ticket, request: GenerationRequest, waiter: asyncio.Future[float]
    ) -> RunningGeneration:
        try:
            dispatched_at = await waiter
        finally:
            del waiter  # an expired waiter keeps its error, whose traceback holds this frame
        running = RunningGeneration(self, ticket, request, dispatched_at)
        self._running[ticket.request_id] = running
        if ticket.request_id in self._preempt_on_start:
            self._preempt_on_start.discard(ticket.request_id)
            running.preempt()
        return running

    async def _leave(self, ticket: Ticket, running: RunningGeneration | None) -> None:
        self._waiters.pop(ticket.request_id, None)
        self._running.pop(ticket.request_id, None)
        self._preempt_on_start.discard(ticket.request_id)
        if running is not None:
            await running.aclose()
        self.core.release(
            ticket.request_id, self.clock(), completed=running.completed if running else False
        )
        self._dispatch()

    def requeue(self, request_id: str) -> asyncio.Future[float]:
        """Queue a preempted generation again; the future resolves when it is re-dispatched."""
        if self.core.requeue(request_id, self.clock()) is None:
            raise RuntimeError(f"{request_id!r} was preempted but is no longer running")
        self._preempted.inc()
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        self._dispatch()
        return waiter

    def _dispatch(self) -> None:
        """Apply the core's decisions now: start what fits, expire what is due, stop the bulk
        it names; poll again if a started ticket's client had already left."""
        core = self.core
        while True:
            now = self.clock()
            step = core.poll(now)
            gone = False
            for ticket in step.started:
                waiter = self._waiters.get(ticket.request_id)
                if waiter is None or waiter.done():  # its client left in the meantime
                    core.release(ticket.request_id, now)
                    gone = True
                    continue
                waiter.set_result(now)
            for ticket in step.expired:
                waiter = self._waiters.get(ticket.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_exception(
                        DeadlineExceeded("the request's deadline passed while it was queued")
                    )
            for ticket in step.preempted:
                running = self._running.get(ticket.request_id)
                if running is None:
                    self._preempt_on_start.add(ticket.request_id)
                else:
                    running.preempt()
            if not gone:
                break
        if not self._stopping:
            self._timer.arm(step.wake_at, now)

    def _gauges_read_at_scrape(self, core: SchedulerCore) -> None:
        """The scheduler's state as gauges that read it when Prometheus scrapes, rather than
        being written at every change of it (two per request, each a dozen gauges)."""
        clock = self.clock
        for tc, gauges in self._class_gauges:
            gauges.queue_depth.set_function(partial(core.queue_depth, tc))
            gauges.queue_oldest_age.set_function(partial(_now, core.oldest_queued_age, tc, clock))
            gauges.running_requests.set_function(partial(core.running_count, tc))
            gauges.autoscale_pressure.set_function(partial(_now, core.pressure, tc, clock))
        for name in core.ledger.in_use():
            self.metrics.budget_in_use.labels(budget=name).set_function(
                partial(_in_use, core, name)
            )
        metrics, model = self.metrics, self.model_name
        for adapter in (None, *self.engine.model.adapters):
            self._export_targets(core, adapter)
        bulk = self.config.slo.bulk
        for name, value in (("ttft", bulk.ttft_s), ("itl", bulk.itl_s)):
            if value is not None:
                metrics.slo_target.labels(model, "bulk", name).set(value)
        self._bulk_cap.set_function(lambda: core.bulk_allowed(clock()))
        self._knee.set_function(core.bulk_cap.knee)
        metrics.chat_gap_share.labels(model).set_function(
            lambda: _or_nan(core.meter.gap_median(clock()))
        )
        metrics.controller_scale.labels(model).set_function(lambda: core.controller.scale)
        metrics.controller_aim.labels(model).set_function(lambda: core.controller.aim)
        limit = metrics.controller_aim_limit
        limit.labels(model, "spread").set_function(lambda: core.controller.spread_limit)
        limit.labels(model, "misses").set_function(lambda: core.controller.ceiling)
        metrics.controller_pace.labels(model).set_function(lambda: core.controller.pace)
        for cause in PreemptCause:
            metrics.bulk_preemptions.set_function(
                (model, cause), partial(core.preempted_for.__getitem__, cause)
            )

    def _export_targets(self, core: SchedulerCore, adapter: str | None) -> None:
        """The interactive targets of chats on `adapter` (None: the base model), under its
        model label, read at each scrape."""
        targets = self.metrics.slo_target
        model = self.model_name if adapter is None else adapter
        read = partial(core.bulk_cap.targets, adapter)
        targets.labels(model, "interactive", "ttft").set_function(lambda: read().ttft_s)
        targets.labels(model, "interactive", "itl").set_function(lambda: read().itl_s)


def _now(
    read: Callable[[TrafficClass, float], float], tc: TrafficClass, clock: Callable[[], float]
) -> float:
    return read(tc, clock())


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _in_use(core: SchedulerCore, budget: str) -> float:
    return core.ledger.in_use()[budget]
