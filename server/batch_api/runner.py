"""Run batches on spare capacity: each line a bulk generation of the batch's tenant.

A window of lines per batch is in the scheduler at once (queued or running); a line the
scheduler refuses for now (queue full, quota used, shutting down) goes back to wait and is
offered again, so a 100,000-line batch never floods the queue and interactive traffic keeps its
place ahead of it. Each line's result is written as the line ends; the batch finalizes when no
line is left, or expires at its window's end, or is cancelled.

Several runners (processes on one data directory, or replicas on one Redis) share a store, and
each batch is run by the one that claims it (`BatchStore.claim`). Every third of `lease_s` a
runner renews its claims, reads what changed elsewhere (a cancel), and claims each active batch
that nobody holds: one just made elsewhere, or one whose runner died and whose lease has passed,
which goes on where its store left it. A runner that stops lets its batches go at once.

Lines on one conversation (`/v1/responses` lines naming it) run one after another, in the
file's order (`Turns`), so that each sees the ones before it; one whose conversation another
response holds (`conversation_locked`) is refused for now, and its conversation's lines wait
`retry_seconds` while the batch's others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from server.batch_api.lines import LineEndpoint, Turns, generation_lines
from server.batch_api.store import STATUSES, Batch, BatchStore, Line
from server.core.errors import ConversationLocked, GenerationCancelled, SluiceError, transient
from server.core.ids import new_id
from server.generations.planner import RequestContext
from server.generations.run import GenerationRun
from server.generations.service import Generations
from server.observability.metrics import Metrics
from server.observability.tracing import TraceParent
from server.scheduler.types import TrafficClass

logger = logging.getLogger("sluice.batches")

EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


def line_result(
    batch: Batch,
    line: Line,
    status: int | None,
    body: dict[str, Any] | None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One line of the output or error file, as OpenAI's."""
    return {
        "id": new_id("batch_request"),
        "custom_id": line.custom_id,
        "response": None
        if status is None
        else {"status_code": status, "request_id": f"{batch.id}-{line.index}", "body": body},
        "error": error,
    }


@dataclass(frozen=True, slots=True)
class Retry:
    """A line refused for now: offered again after `after_s` (the refusal's Retry-After), or
    after the runner's own `retry_seconds` when the refusal named none. `held`: its
    conversation was held by another response, and only the lines on it wait."""

    after_s: float | None
    held: bool = False

    @staticmethod
    def of(error: SluiceError) -> Retry:
        return Retry(error.retry_after, isinstance(error, ConversationLocked))


class BatchRunner:
    """See the module's docstring. `owner`: this runner's name in the store's claims (a
    replica's id; a fresh one by default). `endpoints`: what runs the lines of each endpoint
    a batch may name beside chat and completions' (the Responses API's)."""

    def __init__(
        self,
        generations: Generations,
        store: BatchStore,
        metrics: Metrics,
        lease_s: float = 10.0,
        owner: str | None = None,
        window: int = 64,
        retry_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
        endpoints: Mapping[str, LineEndpoint] | None = None,
    ) -> None:
        self.generations = generations
        self.endpoints = {**generation_lines(generations), **(endpoints or {})}
        self.store = store
        self.metrics = metrics
        self.lease_s = lease_s
        self.owner = owner or uuid.uuid4().hex
        self.window = window
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._batches: dict[str, Batch] = {}  # each batch run here, as last read or written
        self._keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Claim every active batch that nobody holds (after a restart: where the store left
        it), and keep claiming and renewing."""
        await self._beat()
        self._keeper = asyncio.create_task(self._keep())

    async def stop(self) -> None:
        held = list(self._tasks)
        tasks = [*self._tasks.values(), *([self._keeper] if self._keeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for batch_id in held:  # for another runner at once, not after the lease
            with contextlib.suppress(Exception):
                await self.store.release(batch_id, self.owner)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self._beat()

    async def _beat(self) -> None:
        """Renew this runner's claims and learn their batches' statuses; give up a batch
        another runner has claimed; claim those nobody holds."""
        try:
            held = await self.store.renew(self.owner, list(self._tasks), self.lease_s)
            for batch_id, task in list(self._tasks.items()):
                status = held.get(batch_id)
                if status is None:
                    logger.warning("batch %s: its claim was lost; another runner has it", batch_id)
                    task.cancel()
                elif status == "cancelling" and self._batches[batch_id].status != "cancelling":
                    self._batches[batch_id].status = status
                    self._wake[batch_id].set()
            for batch_id in await self.store.claimable(self.owner):
                await self._claim(batch_id)
            await self.count_batches()
        except Exception:  # the store unavailable: the next beat tries again
            logger.exception("batch claims could not be renewed")

    async def submit(self, batch: Batch) -> None:
        """Run a batch just made (if this runner can claim it)."""
        await self._claim(batch.id)

    async def _claim(self, batch_id: str) -> None:
        if batch_id in self._tasks:
            return
        batch = await self.store.claim(batch_id, self.owner, self.lease_s)
        if batch is None or batch_id in self._tasks:
            return
        self._batches[batch_id] = batch
        self._wake[batch_id] = asyncio.Event()
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks[batch_id] = task
        task.add_done_callback(functools.partial(self._forget, batch_id))

    def _forget(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(batch_id, None)
        self._wake.pop(batch_id, None)
        self._batches.pop(batch_id, None)

    async def cancel(self, tenant: str, batch_id: str) -> Batch | None:
        """Mark the batch cancelling (see `BatchStore.cancel`): its runner stops dispatching,
        aborts the running lines and finalizes with what is done. The runner is this one when
        it holds the batch or can claim it now; else the one that holds it, at its next beat."""
        batch = await self.store.cancel(tenant, batch_id, int(self.clock()))
        if batch is not None and batch.status == "cancelling":
            if batch_id in self._wake:
                self._batches[batch_id].status = "cancelling"
                self._wake[batch_id].set()
            else:
                await self._claim(batch_id)
            await self.count_batches()
        return batch

    async def count_batches(self) -> None:
        counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        for status in await self.store.statuses():
            counts[status] = counts.get(status, 0) + 1
        for status, count in counts.items():
            self.metrics.batches.labels(status).set(count)

    async def _run(self, claimed: Batch) -> None:
        """Run the claimed batch's lines until none is pending, or it is cancelled or past its
        window; then finalize it."""
        batch_id, expires_at = claimed.id, claimed.expires_at
        endpoint = self.endpoints[claimed.endpoint]
        # Each line's task, and its index and key.
        running: dict[asyncio.Task[str | Retry], tuple[int, str | None]] = {}
        runs: dict[int, GenerationRun] = {}
        turns = Turns()
        wake = self._wake[batch_id]
        retry_at = 0.0  # after a refusal for capacity, no line is offered before this
        try:
            while True:
                now = self.clock()
                cancelled = self._batches[batch_id].status == "cancelling"
                stopping = cancelled or now >= expires_at
                if stopping:
                    for run in runs.values():
                        run.cancel(
                            GenerationCancelled(
                                "the batch was cancelled"
                                if cancelled
                                else "the batch's window ended"
                            )
                        )
                elif now >= retry_at and len(running) < self.window:
                    # A window's lines looked at: those behind a running line of their key
                    # are passed over for the ones after them.
                    pending = await self.store.pending(
                        batch_id, self.window, skip=[index for index, _ in running.values()]
                    )
                    keyed = [(line, endpoint.key(line.body)) for line in pending]
                    for line, key in turns.startable(keyed, now, self.window - len(running)):
                        turns.started(key)
                        task = asyncio.ensure_future(self._line(claimed, endpoint, line, runs))
                        running[task] = (line.index, key)
                if not running and (stopping or not await self.store.pending(batch_id, 1)):
                    break
                held_until = turns.next_time(now)
                until = min(
                    retry_at if now < retry_at else expires_at,
                    expires_at if held_until is None else held_until,
                    expires_at,
                )
                waker = asyncio.ensure_future(wake.wait())
                done, _ = await asyncio.wait(
                    {*running, waker},
                    return_when=asyncio.FIRST_COMPLETED,
                    timeout=max(0.0, until - now),
                )
                waker.cancel()
                wake.clear()
                for task in [task for task in running if task in done]:
                    _, key = running.pop(task)
                    result = task.result()
                    if isinstance(result, Retry):  # the refusal's Retry-After, if it gave one
                        after = self.retry_seconds if result.after_s is None else result.after_s
                        if result.held and key is not None:  # its conversation's lines wait
                            turns.ended(key, self.clock() + after)
                            continue
                        retry_at = max(retry_at, self.clock() + after)
                    turns.ended(key)
            await self._finalize(claimed)
        except Exception:  # the store failed: let the batch go, for this or another to claim
            logger.exception("batch %s: stopped; it is claimed again at a next beat", batch_id)
            with contextlib.suppress(Exception):
                await self.store.release(batch_id, self.owner)
        finally:
            for run in runs.values():  # stopped, or the claim lost: not left in the engine
                run.cancel(GenerationCancelled("the batch's runner stopped"))
            for task in running:
                task.cancel()

    async def _line(
        self, batch: Batch, endpoint: LineEndpoint, line: Line, runs: dict[int, GenerationRun]
    ) -> str | Retry:
        """Run one line; write its result. `Retry` if it was refused for now."""
        timeline = self.generations.timeline(
            f"{batch.id}-{line.index}",
            endpoint.api,
            TraceParent.of(batch.traceparent, batch.tracestate),
        )
        try:
            context = RequestContext(
                traffic_class=TrafficClass.BULK,
                tenant=self.generations.planner.tenants.tenant(batch.tenant),
                timeout_s=max(1.0, batch.expires_at - self.clock()),
            )
            started = await endpoint.start(line.body, timeline, context)
        except SluiceError as error:
            timeline.fail(error)
            if transient(type(error)):
                self.metrics.batch_line_retries.labels(error.code).inc()
                return Retry.of(error)
            await self._write(batch, line, "failed", error.status, error.to_body())
            return "failed"
        run = runs[line.index] = started.run
        try:
            outcome = await started.outcome()
        finally:
            runs.pop(line.index, None)
        if not isinstance(outcome, SluiceError):
            await self._write(batch, line, "done", 200, outcome)
            return "done"
        if transient(type(outcome)) and not run.dispatched:
            self.metrics.batch_line_retries.labels(outcome.code).inc()
            return Retry.of(outcome)
        if isinstance(outcome, GenerationCancelled):
            return "cancelled"  # stays pending: cancelled or expired with the batch
        await self._write(batch, line, "failed", outcome.status, outcome.to_body())
        return "failed"

    async def _write(
        self, batch: Batch, line: Line, state: str, status: int | None, body: dict[str, Any] | None
    ) -> None:
        """The line's result, and the batch as the store now has it (a cancel made elsewhere
        included)."""
        error = EXPIRED if state == "expired" else None
        result = line_result(batch, line, status, body, error)
        fresh = await self.store.finish_line(batch.id, line.index, state, result)
        if batch.id in self._batches:
            self._batches[batch.id] = fresh
        outcome = {"done": "completed"}.get(state, state)
        self.metrics.batch_lines.labels(outcome).inc()

    async def _finalize(self, batch: Batch) -> None:
        now = int(self.clock())
        if self._batches[batch.id].status == "cancelling":
            status = "cancelled"
        elif now >= batch.expires_at and await self.store.pending(batch.id, 1):
            status = "expired"
            for line in await self.store.pending(batch.id, 1 << 62):
                await self._write(batch, line, "expired", None, None)
        else:
            status = "completed"
        ended = await self.store.finalize(batch.id, status, now)
        await self.count_batches()
        logger.info("batch %s %s: %s", batch.id, ended.status, json.dumps(ended.request_counts))
