"""One request's stopwatch: arrival, dispatch, token writes, end — and every metric they feed.

A route creates a `RequestTimeline` at arrival, calls `dispatched`, `wrote_tokens` (just before
handing generated tokens to the transport) and exactly one `finish(outcome)`, or `fail(error)`
for an error. This is the one place per-request counters and histograms are recorded, the
access line written and, with tracing on, the request's span made (at its end, in one call).

Per-token metrics (generated tokens, the inter-token latency histogram) are accumulated by the
request and flushed into the registry at most every `FLUSH_SECONDS` and at its end, not
observed per token: the histogram's buckets get exactly the counts per-token observations
would have given them. vLLM's series (`vllm:*`) are fed from the same points: the first token,
the flushes (in the same pass), and the end of a request that reached the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import SamplingOptions
from server.core.errors import Outcome, SluiceError
from server.observability.access_log import (
    AccessRecord,
    Api,
    claim_access_line,
    log_request,
    median,
    release_access_line,
)
from server.observability.metrics import Metrics, RequestSeries
from server.observability.tracing import GenerationSpan, TraceParent, Tracing
from server.scheduler.attainment import ChatMeter, Ended
from server.scheduler.slo import SloTargets, slo_result
from server.scheduler.types import Generation

FLUSH_SECONDS = 1.0  # a running request's per-token metrics reach the registry this often


@dataclass(slots=True)
class RequestTimeline:
    request_id: str
    model: str
    api: Api
    metrics: Metrics  # the app's (the one registry its /metrics serves)
    arrival: float = field(default_factory=time.monotonic)
    tenant: str = "-"
    tenant_label: str | None = None  # set only for configured tenants (bounded labels)
    traffic_class: str = "interactive"
    prompt_tokens: int = 0
    trace: TraceParent | None = None  # the trace context it came with
    tracing: Tracing | None = None  # the app's, with tracing on: its span is made at its end
    sampling: SamplingOptions | None = None  # once planned
    generation_id: str | None = None  # its run's public id, once it has one
    queued_at: float | None = None  # admitted to the scheduler's queue
    n: int = 1  # choices
    max_tokens: int = 0  # per choice, as planned (0: not known here)
    dispatched_at: float | None = None
    generation: Generation | None = None  # once dispatched
    first_token_at: float | None = None
    last_write_at: float | None = None
    generated_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # per token: a chunk's gap over its tokens
    # Per chunk, what the gap targets judge: its wait, over the tokens a chunk is meant to hold.
    gaps: list[float] = field(default_factory=list)
    chunk_tokens: int = 1  # the stream's tokens per chunk (its stream interval)
    slo: SloTargets | None = None  # its latency targets when it arrived (None: none)
    meter: ChatMeter | None = None  # where its writes are reported, for the bulk controller
    ended: bool = False
    # False: a generation another replica runs, followed here: its metrics and access log
    # are that replica's (until this one takes it over).
    recorded: bool = True
    clock: Callable[[], float] = time.monotonic  # what its token writes are timed by
    _flushed_tokens: int = 0  # generated tokens counted in the registry
    _flushed_gaps: int = 0  # gaps of `itl` observed in the registry
    _flushed_at: float = 0.0

    def __post_init__(self) -> None:
        if self.recorded:  # the request that made it is logged by `finish`, not the middleware
            claim_access_line()

    def unused(self) -> None:
        """Its request is answered by another request's run (a replay): it records nothing."""
        if not self.ended:
            release_access_line()

    def _series(self) -> RequestSeries:
        return self.metrics.series(self.model, self.traffic_class)

    def dispatched(self, generation: Generation) -> None:
        self.generation = generation
        at = self.dispatched_at = generation.dispatched_at
        series = self._series()
        series.queue_wait.observe(max(0.0, at - self.arrival))
        series.prompt_tokens.inc(self.prompt_tokens)
        if series.vllm is not None:
            series.vllm.prompt_tokens.inc(self.prompt_tokens)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine found in its prefix cache, as its generation keeps them
        (None: not dispatched here, or the engine has not said, yet or at all)."""
        generation = self.generation
        return None if generation is None else generation.cached_tokens

    def wrote_tokens(self, count: int) -> None:
        """Generated tokens are about to be written to the client."""
        if count <= 0:
            return
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = self._flushed_at = now
            series = self._series()
            series.time_to_first_token.observe(now - self.arrival)
            if series.vllm is not None:
                series.vllm.time_to_first_token.observe(now - self.arrival)
        else:
            assert self.last_write_at is not None
            gap = now - self.last_write_at
            if count == 1:
                self.itl.append(gap)
            else:
                self.itl.extend([gap / count] * count)
                # A reader waits the whole gap for this chunk: a token whose text waited for
                # the next (the detokenizer holds a piece of a character) is two steps' wait,
                # not two tokens of one step each.
                gap /= min(count, self.chunk_tokens)
            self.gaps.append(gap)
            if self.meter is not None:
                assert self.slo is not None
                self.meter.gap(gap / self.slo.itl_s, now)
        self.last_write_at = now
        self.generated_tokens += count
        if now - self._flushed_at >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Add the tokens and gaps written since the last flush to the registry."""
        self._flushed_at = self.last_write_at or 0.0
        tokens = self.generated_tokens - self._flushed_tokens
        gaps = self.itl[self._flushed_gaps :]
        if not (tokens or gaps):
            return
        series = self._series()
        if tokens:
            series.generated_tokens.inc(tokens)
            if series.vllm is not None:
                series.vllm.generation_tokens.inc(tokens)
            self._flushed_tokens = self.generated_tokens
        if gaps:
            self._flushed_gaps = len(self.itl)
            series.inter_token_latency.observe_many(gaps)

    def timings(self) -> dict[str, Any]:
        """The request's own timings, in seconds, for the `timings` object beside `usage`."""
        now = time.monotonic()
        return {
            "queue_wait_s": _round(self.dispatched_at - self.arrival)
            if self.dispatched_at is not None
            else None,
            "time_to_first_token_s": _round(self.first_token_at - self.arrival)
            if self.first_token_at is not None
            else None,
            "inter_token_latency_median_s": _round(median(self.itl)),
            "duration_s": _round(now - self.arrival),
        }

    def fail(self, error: SluiceError) -> None:
        """End the request with `error`: its outcome, its status."""
        self.finish(error.outcome, status=error.status, error=error)

    def finish(
        self, outcome: Outcome, *, status: int = 200, error: SluiceError | None = None
    ) -> None:
        if self.ended:
            return
        self.ended = True
        self.flush()
        if not self.recorded:
            return
        now = time.monotonic()
        model, traffic_class = self.model, self.traffic_class
        series = self._series()
        series.request_duration.observe(now - self.arrival)
        series.requests[outcome].inc()
        if self.tenant_label is not None:
            self.metrics.tenant_requests.labels(self.tenant_label, outcome).inc()
        if error is not None and outcome == "rejected":
            self.metrics.rejections.labels(
                model, traffic_class, error.code, self.tenant_label or "other"
            ).inc()
        if outcome == "expired":
            self.metrics.deadline_misses.labels(model, traffic_class).inc()
        if outcome == "cancelled":
            stage = "queued" if self.dispatched_at is None else "running"
            self.metrics.cancellations.labels(model, traffic_class, stage).inc()
        generation = self.generation
        if series.vllm is not None and self.dispatched_at is not None:
            series.vllm.finished(
                self,
                outcome,
                now,
                generation.finish_reasons if generation is not None else (),
                self.cached_tokens,
            )
        if self.dispatched_at is not None and outcome in ("cancelled", "expired"):
            # Sluice aborted the engine request: the client left, or the deadline passed.
            reason = "client_cancelled" if outcome == "cancelled" else "deadline"
            self.metrics.engine_aborts.labels(model, reason).inc()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        median_gap = median(self.gaps)
        if median_gap is not None:
            series.stream_median_gap.observe(median_gap)
        verdict = slo_result(
            outcome,
            error is not None and error.capacity,
            now - self.arrival,
            ttft,
            median_gap,
            self.slo,
        )
        if verdict is not None:
            self.metrics.slo_requests.labels(model, traffic_class, *verdict).inc()
            if self.meter is not None:
                assert self.slo is not None
                self.meter.ended(Ended.of(self.slo, median_gap_s=median_gap))
        median_itl = median(self.itl)
        trace_id = None
        if self.tracing is not None:
            trace_id = self.tracing.export(
                self._span(now, outcome, status, error, verdict, median_itl)
            )
        elif self.trace is not None:
            trace_id = self.trace.trace_id
        log_request(
            AccessRecord(
                request_id=self.request_id,
                tenant=self.tenant,
                traffic_class=traffic_class,
                model=model,
                outcome=outcome,
                status=status,
                ttft_s=ttft,
                median_itl_s=median_itl,
                duration_s=now - self.arrival,
                prompt_tokens=self.prompt_tokens,
                generated_tokens=self.generated_tokens,
                api=self.api,
                preemptions=generation.preemptions if generation is not None else 0,
                cached_tokens=self.cached_tokens,
                trace_id=trace_id,
            )
        )

    def _span(
        self,
        now: float,
        outcome: Outcome,
        status: int,
        error: SluiceError | None,
        verdict: tuple[str, str] | None,
        median_itl: float | None,
    ) -> GenerationSpan:
        generation, sampling = self.generation, self.sampling
        return GenerationSpan(
            request_id=self.request_id,
            api=self.api,
            model=self.model,
            tenant=self.tenant,
            traffic_class=self.traffic_class,
            outcome=outcome,
            status=status,
            arrival=self.arrival,
            ended=now,
            parent=self.trace,
            queued=self.queued_at,
            dispatched=self.dispatched_at,
            first_token=self.first_token_at,
            last_token=self.last_write_at,
            pauses=generation.pauses if generation is not None else (),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.generated_tokens,
            cached_tokens=self.cached_tokens,
            median_itl_s=median_itl,
            max_tokens=sampling.max_tokens if sampling is not None else None,
            temperature=sampling.temperature if sampling is not None else None,
            top_p=sampling.top_p if sampling is not None else None,
            n=sampling.n if sampling is not None else None,
            generation_id=self.generation_id,
            slo=verdict,
            error=error.code if error is not None else None,
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
