"""Run batches on spare capacity: each line a bulk generation of the batch's tenant.

A window of lines per batch is in the scheduler at once (queued or running); a line the
scheduler refuses for now (queue full, quota used, shutting down) goes back to wait and is
offered again, so a 100,000-line batch never floods the queue and interactive traffic keeps its
place ahead of it. Each line's result is written as the line ends; the batch finalizes when no
line is left, or expires at its window's end, or is cancelled. A restart picks up every active
batch where its store left it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from server.batch_api.store import STATUSES, Batch, BatchStore, Line
from server.core.errors import (
    GenerationCancelled,
    SluiceError,
)
from server.generations.planner import RequestContext
from server.generations.run import GenerationRun, Kind
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.observability.metrics import Metrics
from server.openai.requests import parse_request
from server.scheduler.types import TrafficClass

logger = logging.getLogger("sluice.batches")

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def line_result(
    batch: Batch,
    line: Line,
    status: int | None,
    body: dict[str, Any] | None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One line of the output or error file, as OpenAI's."""
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": line.custom_id,
        "response": None
        if status is None
        else {"status_code": status, "request_id": f"{batch.id}-{line.index}", "body": body},
        "error": error,
    }


class BatchRunner:
    def __init__(
        self,
        generations: Generations,
        store: BatchStore,
        metrics: Metrics,
        window: int = 64,
        retry_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.generations = generations
        self.store = store
        self.metrics = metrics
        self.window = window
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._wake: dict[str, asyncio.Event] = {}
        self._batches: dict[str, Batch] = {}  # the one instance of each batch being run

    def start(self) -> None:
        """Take up every active batch (after a restart: where the store left it)."""
        for batch in self.store.active():
            self.submit(batch)
        self.count_batches()

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def live(self, batch: Batch) -> Batch:
        """The instance being run of `batch` (which changes there), or `batch` itself."""
        return self._batches.get(batch.id, batch)

    def submit(self, batch: Batch) -> None:
        if batch.id not in self._tasks:
            self._batches[batch.id] = batch
            self._wake[batch.id] = asyncio.Event()
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks[batch.id] = task
            task.add_done_callback(functools.partial(self._forget, batch.id))

    def _forget(self, batch_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(batch_id, None)
        self._wake.pop(batch_id, None)
        self._batches.pop(batch_id, None)

    def cancel(self, batch: Batch) -> None:
        """Stop dispatching, abort the running lines, finalize with what is done."""
        batch.status = "cancelling"
        batch.times["cancelling"] = int(self.clock())
        self.store.save(batch)
        self.count_batches()
        if batch.id in self._wake:
            self._wake[batch.id].set()
        else:
            self.submit(batch)

    def count_batches(self) -> None:
        counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        for status in self.store.statuses():
            counts[status] = counts.get(status, 0) + 1
        for status, count in counts.items():
            self.metrics.batches.labels(status).set(count)

    async def _run(self, batch: Batch) -> None:
        running: dict[asyncio.Task[str], int] = {}  # each line's task, and its index
        runs: dict[int, GenerationRun] = {}
        wake = self._wake[batch.id]
        retry_at = 0.0  # after a refusal, no line is offered before this
        try:
            while True:
                now = self.clock()
                stopping = batch.status == "cancelling" or now >= batch.expires_at
                if stopping:
                    for run in runs.values():
                        run.cancel(
                            GenerationCancelled(
                                "the batch was cancelled"
                                if batch.status == "cancelling"
                                else "the batch's window ended"
                            )
                        )
                elif now >= retry_at and len(running) < self.window:
                    for line in self.store.pending(
                        batch.id, self.window - len(running), skip=running.values()
                    ):
                        running[asyncio.ensure_future(self._line(batch, line, runs))] = line.index
                if not running and (stopping or not self.store.pending(batch.id, 1)):
                    break
                until = retry_at if now < retry_at else batch.expires_at
                waker = asyncio.ensure_future(wake.wait())
                done, _ = await asyncio.wait(
                    {*running, waker},
                    return_when=asyncio.FIRST_COMPLETED,
                    timeout=max(0.0, min(until, batch.expires_at) - now),
                )
                waker.cancel()
                wake.clear()
                for task in done - {waker}:
                    del running[task]  # type: ignore[arg-type]
                    if task.result() == "retry":
                        retry_at = self.clock() + self.retry_seconds
            self._finalize(batch)
        finally:
            for task in running:
                task.cancel()

    async def _line(self, batch: Batch, line: Line, runs: dict[int, GenerationRun]) -> str:
        """Run one line; write its result. "retry" if the scheduler refused it for now."""
        kind = KINDS[batch.endpoint]
        timeline = RequestTimeline(
            request_id=f"{batch.id}-{line.index}",
            model=self.generations.planner.served_model,
            api="chat" if kind == "chat" else "completions",
            metrics=self.metrics,
        )
        context = RequestContext(
            traffic_class=TrafficClass.BULK,
            tenant=self.generations.planner.tenants.tenant(batch.tenant),
            timeout_s=max(1.0, batch.expires_at - self.clock()),
        )
        try:
            run, _ = await self.generations.generate(
                parse_request(line.body, kind), line.body, timeline, context, None, stream=False
            )
        except SluiceError as error:
            timeline.finish(error.outcome, status=error.status, error=error)
            if error.retryable:
                return "retry"
            self._write(batch, line, "failed", error.status, error.to_body())
            return "failed"
        runs[line.index] = run
        try:
            with run.reading():
                last = await run.until_ended()
        finally:
            runs.pop(line.index, None)
        if last.kind is Kind.WHOLE:
            self._write(batch, line, "done", 200, last.body)
            return "done"
        failure = last.error
        assert failure is not None
        if failure.retryable and not run.dispatched:
            return "retry"
        if isinstance(failure, GenerationCancelled):
            return "cancelled"  # stays pending: cancelled or expired with the batch
        self._write(batch, line, "failed", failure.status, failure.to_body())
        return "failed"

    def _write(
        self, batch: Batch, line: Line, state: str, status: int, body: dict[str, Any] | None
    ) -> None:
        self.store.finish_line(batch, line.index, state, line_result(batch, line, status, body))
        self.metrics.batch_lines.labels("completed" if state == "done" else "failed").inc()

    def _finalize(self, batch: Batch) -> None:
        now = int(self.clock())
        if batch.status == "cancelling":
            status = "cancelled"
        elif now >= batch.expires_at and self.store.pending(batch.id, 1):
            status = "expired"
            for line in self.store.pending(batch.id, 1 << 62):
                self.store.finish_line(
                    batch,
                    line.index,
                    "expired",
                    line_result(
                        batch,
                        line,
                        None,
                        None,
                        {
                            "code": "batch_expired",
                            "message": "This "
                            "request could not be executed before the "
                            "completion window expired.",
                        },
                    ),
                )
                self.metrics.batch_lines.labels("expired").inc()
        else:
            status = "completed"
        if status == "completed":
            batch.status, batch.times["finalizing"] = "finalizing", now
            self.store.save(batch)
        output = "".join(r + "\n" for r in self.store.results(batch.id, "done")).encode()
        errors = "".join(
            r + "\n" for state in ("failed", "expired") for r in self.store.results(batch.id, state)
        ).encode()
        self.store.finalize(batch, status, output, errors, now)
        self.count_batches()
        logger.info("batch %s %s: %s", batch.id, status, json.dumps(batch.request_counts))
