"""The asyncio shell around `SchedulerCore`: futures for queued requests, one expiry timer,
deadlines on running streams, gauges recorded at every state change.

The core decides; this module only turns decisions into asyncio events (resolving a waiter's
future, failing it with DeadlineExceeded) and calls the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager

from engine_adapters.protocol import EngineClient, GenerationRequest, TokenDelta
from server import metrics
from server.config import SluiceConfig
from server.errors import DeadlineExceeded, EngineUnavailable
from server.scheduler.budgets import BudgetLimits
from server.scheduler.core import Rejected, SchedulerCore
from server.scheduler.types import Ticket, TrafficClass
from server.scheduler.wakeup import WakeupTimer


class RunningGeneration:
    """A dispatched ticket's stream: engine deltas until the end or the deadline."""

    def __init__(
        self, runtime: SchedulerRuntime, ticket: Ticket, request: GenerationRequest,
        dispatched_at: float,
    ) -> None:
        self._runtime = runtime
        self._ticket = ticket
        self._request = request
        self._dispatched_at = dispatched_at
        self.output_tokens = 0
        self.completed = False
        self._stream_iter: AsyncGenerator[TokenDelta, None] | None = None

    @property
    def dispatched_at(self) -> float:
        return self._dispatched_at

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        if self._stream_iter is not None:
            raise RuntimeError("a generation can be iterated once")
        self._stream_iter = self._stream()
        return self._stream_iter

    async def aclose(self) -> None:
        """Stop the stream (and with it the engine request) if the consumer left it early."""
        if self._stream_iter is not None:
            await self._stream_iter.aclose()

    async def _stream(self) -> AsyncGenerator[TokenDelta, None]:
        """Engine deltas, cut at the deadline by one timer per request (not one per token).

        The timer only marks the deadline as passed; if the stream is then waiting on the
        engine it cancels that wait, which aborts the engine request. Either way the next
        step raises DeadlineExceeded. Time spent writing to the client is not interrupted here
        (the transport's send timeout bounds it).
        """
        runtime, ticket = self._runtime, self._ticket
        task = asyncio.current_task()
        assert task is not None
        deadline_passed = False
        waiting_on_engine = False

        def on_deadline() -> None:
            nonlocal deadline_passed
            deadline_passed = True
            if waiting_on_engine:
                task.cancel()

        timer = asyncio.get_running_loop().call_later(
            max(0.0, ticket.deadline - runtime.clock()), on_deadline
        )
        deltas = runtime.engine.generate(self._request)
        first_token_seen = False
        try:
            while True:
                if deadline_passed:
                    raise DeadlineExceeded("the request's deadline passed while generating")
                waiting_on_engine = True
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if deadline_passed and task.uncancel() == 0:
                        raise DeadlineExceeded(
                            "the request's deadline passed while generating"
                        ) from None
                    raise
                finally:
                    waiting_on_engine = False
                if delta.token_ids:
                    if not first_token_seen:
                        first_token_seen = True
                        runtime.core.first_token(ticket.request_id, runtime.clock())
                    self.output_tokens += len(delta.token_ids)
                if delta.finish_reason is not None and delta.finish_reason != "abort":
                    self.completed = True
                yield delta
        finally:
            timer.cancel()
            await deltas.aclose()  # type: ignore[attr-defined]


class SchedulerRuntime:
    """Implements `Dispatcher` for continuous-batching engines."""

    def __init__(
        self,
        config: SluiceConfig,
        engine: EngineClient,
        model_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.clock = clock
        self._core: SchedulerCore | None = None
        self._waiters: dict[str, asyncio.Future[float]] = {}
        self._timer = WakeupTimer(self._dispatch)
        self._stopping = False

    @property
    def core(self) -> SchedulerCore:
        if self._core is None:
            raise RuntimeError("SchedulerRuntime.start() has not run")
        return self._core

    async def start(self) -> None:
        """Size the budgets from the engine's KV cache (the engine must have started)."""
        kv = self.engine.kv_cache
        if kv is None:
            raise RuntimeError("the engine reports no KV cache; start it first")
        limits = BudgetLimits.from_engine(
            self.config.budgets,
            block_size=kv.block_size,
            num_blocks=kv.num_blocks,
            max_model_len=self.engine.model.max_model_len,
            engine_max_seqs=self.engine.model.extra.get("max_num_seqs"),
        )
        self._core = SchedulerCore(self.config, limits)
        self._stopping = False
        for name, limit in self._core.ledger.limits_by_name().items():
            metrics.BUDGET_LIMIT.labels(budget=name).set(limit)
        self._record_state()

    async def stop(self) -> None:
        """Refuse queued requests; running streams end with their engine requests."""
        self._stopping = True
        self._timer.cancel()
        for future in self._waiters.values():
            if not future.done():
                future.set_exception(EngineUnavailable("the server is shutting down"))
        self._waiters.clear()

    @asynccontextmanager
    async def generation(
        self, ticket: Ticket, request: GenerationRequest
    ) -> AsyncIterator[RunningGeneration]:
        if self._stopping:
            raise EngineUnavailable("the server is shutting down")
        core = self.core
        decision = core.submit(ticket, self.clock())
        if isinstance(decision, Rejected):
            self._record_state()
            raise decision.to_error()
        waiter: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = waiter
        running: RunningGeneration | None = None
        try:
            self._dispatch()
            dispatched_at = await waiter
            running = RunningGeneration(self, ticket, request, dispatched_at)
            yield running
        finally:
            self._waiters.pop(ticket.request_id, None)
            if running is not None:
                await running.aclose()
            core.release(
                ticket.request_id, self.clock(),
                output_tokens=running.output_tokens if running else 0,
                completed=running.completed if running else False,
            )
            self._dispatch()

    def _dispatch(self) -> None:
        """Apply the core's decisions now: expire what is due, start what fits."""
        core = self.core
        now = self.clock()
        for ticket in core.dispatchable(now):
            waiter = self._waiters.get(ticket.request_id)
            if waiter is None or waiter.done():  # its client left in the meantime
                core.release(ticket.request_id, now)
                continue
            waiter.set_result(now)
        for ticket in core.expire(now):
            waiter = self._waiters.get(ticket.request_id)
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    DeadlineExceeded("the request's deadline passed while it was queued")
                )
        if not self._stopping:
            self._timer.arm(self.core.next_wakeup(), now)
        self._record_state()

    def _record_state(self) -> None:
        core = self.core
        now = self.clock()
        for tc in TrafficClass:
            labels = {"model": self.model_name, "traffic_class": tc.value}
            metrics.QUEUE_DEPTH.labels(**labels).set(core.queue_depth(tc))
            metrics.QUEUE_OLDEST_AGE.labels(**labels).set(core.oldest_queued_age(tc, now))
            metrics.RUNNING_REQUESTS.labels(**labels).set(core.running_count(tc))
            metrics.AUTOSCALE_PRESSURE.labels(**labels).set(core.pressure(tc, now))
        for name, in_use in core.ledger.in_use().items():
            metrics.BUDGET_IN_USE.labels(budget=name).set(in_use)
