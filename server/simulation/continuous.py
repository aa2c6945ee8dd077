"""`sluice simulate --mode continuous`: the scheduler core and the `sim` timing model, driven
on a virtual clock by the discrete-event loop.

The same `SchedulerCore` as the server decides admission, dispatch and expiry; this shell only
applies each `Step` it returns: an arrival submits, a dispatch adds the request to the
`SimTimingModel`, each engine step's outputs arrive `duration_s` later, a deadline expires a
queued ticket or aborts a running one, and every ending releases the ticket in the core. A
preempted bulk request is aborted in the model and requeued; it resumes under a new engine id,
so outputs of the step that was running when it stopped are dropped. As the server calibrates
on its engine, the simulator first runs the same probe on the timing model.

Besides open arrivals, `add_bulk_streams` runs closed-loop bulk streams (each sends its next
request when the previous one ends), the shape of the flood benchmark. Every request that ends
gets the server's SLO verdict, against the targets in force when it arrived.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from engine_adapters.sim_model import (
    SPECIAL_TOKENS,
    SimConfig,
    SimTimingModel,
    StepResult,
    add_sim_arguments,
    stable_hash,
)
from server.core.config import SluiceConfig, TenantConfig
from server.core.settings import add_arguments, load_config
from server.scheduler.budgets import BudgetLimits
from server.scheduler.calibration import seed
from server.scheduler.core import Rejected, SchedulerCore
from server.scheduler.refusals import REFUSALS
from server.scheduler.slo import slo_result
from server.scheduler.types import RejectReason, SloTargets, Ticket, TrafficClass
from server.simulation.continuous_workload import (
    RequestShape,
    WorkloadMix,
    burst_mix,
    parse_tenant_weights,
    poisson_mix,
)
from server.simulation.events import EventHandle, EventLoop
from server.simulation.probe import probe_timing_model
from server.simulation.workload import DEFAULT_MODEL, Arrival, TraceError, parse_trace


@dataclass(slots=True)
class Timeline:
    """One request's life in virtual seconds; outcome completed|rejected|expired|cancelled."""

    id: str
    tenant: str
    traffic_class: str
    arrival: float
    deadline: float
    outcome: str = "queued"
    reason: RejectReason | None = None
    stage: str | None = None  # where an expiry or cancellation caught it
    dispatched: float | None = None
    first_token: float | None = None
    finished: float | None = None
    output_tokens: int = 0
    preemptions: int = 0
    median_gap: float | None = None  # of its tokens' gaps, once completed
    slo: str | None = None  # "met", "missed:<reason>", or None when it does not count


@dataclass(frozen=True, slots=True)
class BulkStreams:
    """Closed-loop bulk streams: each sends its next request when the previous one ends."""

    count: int
    shape: RequestShape
    until_s: float
    tenant: str = "default"
    retry_s: float = 0.1  # after a refusal


class ContinuousSimulation:
    def __init__(self, config: SluiceConfig, sim: SimConfig) -> None:
        self.config = config
        self.loop = EventLoop()
        self.model = SimTimingModel(sim)
        self.core = SchedulerCore(
            config,
            BudgetLimits.from_engine(config.budgets, sim.model_info(DEFAULT_MODEL)),
        )
        if config.estimates.calibrate:
            seed(
                self.core.estimates,
                probe_timing_model(sim, max_sequences=self.core.ledger.limits.sequences),
            )
        self.timelines: dict[str, Timeline] = {}
        self.peak_budget_in_use = dict.fromkeys(self.core.ledger.in_use(), 0)
        self._targets: dict[str, SloTargets] = {}  # interactive requests' targets at arrival
        self._gaps: dict[str, list[float]] = {}  # running requests' gaps so far
        self._last_token_at: dict[str, float] = {}
        self._tokens: dict[str, list[int]] = {}  # dispatched requests' prompt and output
        # request id -> (the bulk stream that sent it, its number in that stream)
        self._streams: dict[str, tuple[int, int]] = {}
        self._bulk_streams: BulkStreams | None = None
        self._stepping = False
        self._wakeup: EventHandle | None = None
        self._running_deadlines: dict[str, EventHandle] = {}
        self._engine_ids: dict[str, str] = {}  # request id -> its current engine request id
        self._requests: dict[str, str] = {}  # engine request id -> request id

    # --- inputs ------------------------------------------------------------------------
    def add_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        for arrival in arrivals:
            self.loop.call_at(arrival.time_s, partial(self._arrive, arrival))

    def add_bulk_streams(self, streams: BulkStreams) -> None:
        self._bulk_streams = streams
        for n in range(streams.count):
            self.loop.call_at(0.0, partial(self._next_in_stream, n, 0))

    def _next_in_stream(self, stream: int, sequence: int) -> None:
        streams = self._bulk_streams
        assert streams is not None
        now = self.loop.now
        if now >= streams.until_s:
            return
        request_id = f"bulk{stream}.{sequence}"
        self._streams[request_id] = (stream, sequence)
        shape = streams.shape
        self._arrive(
            Arrival(
                request_id,
                now,
                None if shape.deadline_s is None else now + shape.deadline_s,
                TrafficClass.BULK,
                streams.tenant,
                shape.prompt_tokens,
                shape.max_tokens,
            )
        )

    def cancel_at(self, request_id: str, time_s: float) -> None:
        self.loop.call_at(time_s, partial(self._cancel, request_id))

    def run(self, until: float | None = None) -> None:
        self.loop.run(until)

    # --- events ------------------------------------------------------------------------
    def _arrive(self, arrival: Arrival) -> None:
        now = self.loop.now
        tc = arrival.traffic_class
        deadline = arrival.deadline_s
        if deadline is None:
            deadline = now + self.config.classes[tc].deadline_s
        ticket = Ticket(
            arrival.id,
            arrival.tenant,
            tc,
            arrival.model,
            now,
            deadline,
            arrival.prompt_tokens,
            arrival.max_tokens,
        )
        timeline = Timeline(arrival.id, arrival.tenant, tc.value, now, deadline)
        self.timelines[arrival.id] = timeline
        if tc is TrafficClass.INTERACTIVE:
            self._targets[arrival.id] = self.core.bulk_cap.targets()
        decision = self.core.submit(ticket, now)
        if isinstance(decision, Rejected):
            timeline.reason = decision.reason
            self._end(timeline, "rejected", None)
            return
        self._dispatch()

    def _dispatch(self) -> None:
        now = self.loop.now
        core = self.core
        while True:
            step = core.poll(now)
            for ticket in step.started:
                self._start(ticket, now)
            for ticket in step.expired:
                self._end(self.timelines[ticket.request_id], "expired", "queued")
            for ticket in step.preempted:
                self._preempt(ticket.request_id)  # requeued at once: poll again
            if not step.preempted:
                break
        for name, value in core.ledger.in_use().items():
            if value > self.peak_budget_in_use[name]:
                self.peak_budget_in_use[name] = value
        self._arm_wakeup(step.wake_at)
        if not self._stepping and self.model.has_work:
            self._stepping = True
            self._step()

    def _start(self, ticket: Ticket, now: float) -> None:
        rid = ticket.request_id
        timeline = self.timelines[rid]
        engine_id = rid if timeline.preemptions == 0 else f"{rid}~{timeline.preemptions}"
        self._engine_ids[rid], self._requests[engine_id] = engine_id, rid
        tokens = self._tokens.get(rid)
        if tokens is None:  # its own prompt, so that the engine's prefix cache is honest
            tokens = self._tokens[rid] = self._prompt(rid, ticket.prompt_tokens)
        # A continuation's prompt is its first prompt and everything it generated since.
        assert len(tokens) == ticket.prompt_tokens
        self.model.add(engine_id, list(tokens), ticket.max_tokens, ignore_eos=True)
        if timeline.dispatched is None:
            timeline.dispatched = now
        timeline.outcome = "running"
        self._running_deadlines[rid] = self.loop.call_at(
            max(now, ticket.deadline), partial(self._running_deadline, rid)
        )

    def _prompt(self, request_id: str, length: int) -> list[int]:
        first = len(SPECIAL_TOKENS)
        span = self.model.config.vocab_size - first
        offset = stable_hash(request_id)
        return [first + (offset + i) % span for i in range(length)]

    def _stop_engine_request(self, request_id: str) -> None:
        engine_id = self._engine_ids.pop(request_id)
        del self._requests[engine_id]
        self.model.abort(engine_id)

    def _preempt(self, request_id: str) -> None:
        self._running_deadlines.pop(request_id).cancel()
        self._stop_engine_request(request_id)
        timeline = self.timelines[request_id]
        self.core.requeue(request_id, self.loop.now)
        timeline.outcome = "queued"
        timeline.preemptions += 1

    def _arm_wakeup(self, wake: float | None) -> None:
        if self._wakeup is not None:
            if wake is not None and self._wakeup.time == wake:
                return
            self._wakeup.cancel()
            self._wakeup = None
        if wake is not None:
            self._wakeup = self.loop.call_at(max(wake, self.loop.now), self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._dispatch()

    def _step(self) -> None:
        result = self.model.step()
        self.loop.call_later(result.duration_s, partial(self._deliver, result))

    def _deliver(self, result: StepResult) -> None:
        now = self.loop.now
        for output in result.outputs:
            rid = self._requests.get(output.request_id)
            if rid is None:
                continue  # aborted while the step ran: a late output revives nothing
            timeline = self.timelines[rid]
            count = len(output.token_ids)
            self.core.generated(rid, count, now)
            if timeline.first_token is None:
                timeline.first_token = now
            else:
                gap = (now - self._last_token_at[rid]) / count
                self._gaps.setdefault(rid, []).extend([gap] * count)
            self._last_token_at[rid] = now
            timeline.output_tokens += count
            self._tokens[rid].extend(output.token_ids)
            if output.finish_reason is not None:
                self._running_deadlines.pop(rid).cancel()
                del self._requests[self._engine_ids.pop(rid)]
                self.core.release(rid, now, completed=True)
                self._end(timeline, "completed", None)
        self._stepping = False
        self._dispatch()

    def _running_deadline(self, request_id: str) -> None:
        self._running_deadlines.pop(request_id, None)
        self._abort_running(request_id, "expired")

    def _abort_running(self, request_id: str, outcome: str) -> None:
        self._stop_engine_request(request_id)
        timeline = self.timelines[request_id]
        self.core.release(request_id, self.loop.now)
        self._end(timeline, outcome, "running")
        self._dispatch()

    def _cancel(self, request_id: str) -> None:
        timeline = self.timelines.get(request_id)
        if timeline is None or timeline.outcome not in ("queued", "running"):
            return
        if timeline.outcome == "running":
            self._running_deadlines.pop(request_id).cancel()
            self._abort_running(request_id, "cancelled")
            return
        self.core.release(request_id, self.loop.now)
        self._end(timeline, "cancelled", "queued")
        self._dispatch()

    def _end(self, timeline: Timeline, outcome: str, stage: str | None) -> None:
        now = self.loop.now
        timeline.outcome, timeline.stage, timeline.finished = outcome, stage, now
        self._last_token_at.pop(timeline.id, None)
        self._tokens.pop(timeline.id, None)
        gaps = self._gaps.pop(timeline.id, None)
        if gaps:
            timeline.median_gap = statistics.median(gaps)
        ttft = None if timeline.first_token is None else timeline.first_token - timeline.arrival
        verdict = slo_result(
            outcome,
            timeline.reason is not None and REFUSALS[timeline.reason].capacity,
            now - timeline.arrival,
            ttft,
            timeline.median_gap,
            self._targets.pop(timeline.id, None),
        )
        timeline.slo = (
            None if verdict is None else ("met" if verdict[0] == "met" else f"missed:{verdict[1]}")
        )
        sent_by = self._streams.pop(timeline.id, None)
        if sent_by is not None:
            assert self._bulk_streams is not None
            stream, sequence = sent_by
            delay = self._bulk_streams.retry_s if outcome == "rejected" else 0.0
            self.loop.call_at(now + delay, partial(self._next_in_stream, stream, sequence + 1))


# --- reporting ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(simulation: ContinuousSimulation, wall_s: float) -> dict[str, Any]:
    timelines = list(simulation.timelines.values())
    targets = simulation.core.bulk_cap.targets()
    end = max((t.finished or t.arrival for t in timelines), default=0.0)
    by_class: dict[str, Any] = {}
    for tc in TrafficClass:
        mine = [t for t in timelines if t.traffic_class == tc.value]
        done = [t for t in mine if t.outcome == "completed"]
        outcomes: dict[str, int] = {}
        slo: dict[str, int] = {}
        for t in mine:
            key = t.outcome if t.reason is None else f"rejected:{t.reason}"
            outcomes[key] = outcomes.get(key, 0) + 1
            if t.slo is not None:
                slo[t.slo] = slo.get(t.slo, 0) + 1
        judged = sum(slo.values())
        ms = _percentiles_ms
        by_class[tc.value] = {
            "requests": len(mine),
            "outcomes": dict(sorted(outcomes.items())),
            "queue_wait_ms": ms(
                [t.dispatched - t.arrival for t in mine if t.dispatched is not None]
            ),
            "ttft_ms": ms([t.first_token - t.arrival for t in done if t.first_token is not None]),
            "latency_ms": ms([t.finished - t.arrival for t in done if t.finished is not None]),
            "completed_after_deadline": sum(
                1 for t in done if t.finished is not None and t.finished > t.deadline
            ),
            "median_gap_ms": ms([t.median_gap for t in done if t.median_gap is not None]),
            "tokens_per_s": round(sum(t.output_tokens for t in done) / end, 1) if end else 0.0,
            "preemptions": sum(t.preemptions for t in mine),
            "slo": dict(sorted(slo.items())),
            "slo_met_share": round(slo.get("met", 0) / judged, 4) if judged else None,
        }
    tenants: dict[str, int] = {}
    for t in timelines:
        if t.outcome == "completed":
            tenants[t.tenant] = tenants.get(t.tenant, 0) + t.output_tokens
    return {
        "requests": len(timelines),
        "virtual_seconds": round(end, 3),
        "wall_seconds": round(wall_s, 3),
        "classes": by_class,
        "completed_tokens_by_tenant": dict(sorted(tenants.items())),
        "budget_limits": simulation.core.ledger.limits_by_name(),
        "budget_peak_in_use": simulation.peak_budget_in_use,
        "budget_in_use_at_end": simulation.core.ledger.in_use(),
        "slo_targets_ms": {
            "ttft": round(1000 * targets.ttft_s, 3),
            "itl": round(1000 * targets.itl_s, 3),
        },
        "bulk_knee": simulation.core.bulk_cap.knee(),
        "engine_unfinished_at_end": simulation.model.num_unfinished,
    }


def _percentiles_ms(seconds: list[float]) -> dict[str, float | None]:
    result: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        value = percentile(seconds, q)
        result[name] = None if value is None else round(value * 1000, 3)
    return result


# --- CLI ---------------------------------------------------------------------------------
class ContinuousOptions(BaseModel):
    """The flags of `simulate --mode continuous` (the `--sim-*` engine flags apart)."""

    config: Path | None = Field(None, description="scheduler YAML (tenants, budgets)")
    interactive_share: float | None = Field(
        None,
        description="share of generated arrivals that are interactive (default 1; 0.5 for mixed)",
    )
    tenants: str | None = Field(
        None,
        description="tenants of generated arrivals and their weights (default 'default'; mixed: "
        "'flood=9,steady=1')",
        json_schema_extra={"metavar": "NAME=WEIGHT,..."},
    )
    prompt_tokens: int = Field(64, description="prompt tokens of interactive arrivals")
    max_tokens: int = Field(32, description="max_tokens of interactive arrivals")
    bulk_prompt_tokens: int = 256
    bulk_max_tokens: int = 256
    burst_size: int = Field(20, description="arrivals per burst (--workload bursts)")
    bulk_streams: int = Field(
        0,
        description="besides the arrivals, N closed-loop bulk streams for --duration seconds (each "
        "sends its next request when the previous ends; shaped by --bulk-*-tokens)",
        json_schema_extra={"metavar": "N"},
    )


def add_simulate_arguments(simulate_parser: argparse.ArgumentParser) -> None:
    group = simulate_parser.add_argument_group("continuous mode (--mode continuous)")
    add_arguments(group, ContinuousOptions)
    add_sim_arguments(simulate_parser)


def build_arrivals(args: argparse.Namespace) -> list[Arrival] | Iterable[Arrival]:
    if args.arrivals:
        return parse_trace(args.arrivals)
    workload = args.workload or "poisson"
    share = args.interactive_share
    if share is None:
        share = 0.5 if workload == "mixed" else 1.0
    tenants = args.tenants or ("flood=9,steady=1" if workload == "mixed" else "default")
    relative = None if args.deadline_ms is None else args.deadline_ms / 1000.0
    mix = WorkloadMix(
        interactive_share=share,
        tenants=parse_tenant_weights(tenants),
        interactive=RequestShape(args.prompt_tokens, args.max_tokens, relative),
        bulk=RequestShape(args.bulk_prompt_tokens, args.bulk_max_tokens, relative),
    )
    if workload == "bursts":
        return burst_mix(args.rate, args.duration, args.burst_size, mix, args.seed)
    return poisson_mix(args.rate, args.duration, mix, args.seed)


def with_tenants(config: SluiceConfig, names: Iterable[str]) -> SluiceConfig:
    """Make every simulated tenant a configured one, so per-tenant rules apply to it."""
    tenants = dict(config.tenants)
    for name in names:
        tenants.setdefault(name, TenantConfig(name=name))
    if len(tenants) > 1 and config.is_open and "default" not in names:
        tenants.pop("default", None)
    return config.model_copy(update={"tenants": tenants})


def run(args: argparse.Namespace) -> int:
    try:
        arrivals = list(build_arrivals(args))
    except (TraceError, ValueError) as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 2
    config = with_tenants(load_config(args.config), {a.tenant for a in arrivals} or {"default"})
    simulation = ContinuousSimulation(config, SimConfig.from_args(args))
    simulation.add_arrivals(arrivals)
    if args.bulk_streams:
        simulation.add_bulk_streams(
            BulkStreams(
                args.bulk_streams,
                RequestShape(args.bulk_prompt_tokens, args.bulk_max_tokens, None),
                until_s=args.duration,
                tenant=next(iter(config.tenants)),
            )
        )
    for item in args.cancel:
        rid, _, at = item.partition("@")
        simulation.cancel_at(rid, float(at) / 1000.0)
    started = time.perf_counter()
    simulation.run()
    summary = summarize(simulation, time.perf_counter() - started)
    if args.json:
        timelines = [asdict(t) for t in simulation.timelines.values()]
        json.dump({"summary": summary, "requests": timelines}, sys.stdout)
        print()
    else:
        print(json.dumps(summary, indent=2))
    return 0
