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
import statistics
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import cache, partial
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
from server.scheduler.attainment import Ended
from server.scheduler.budgets import BudgetLimits
from server.scheduler.calibration import seed
from server.scheduler.core import Rejected, SchedulerCore
from server.scheduler.refusals import REFUSALS
from server.scheduler.slo import SloTargets, slo_result
from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass
from server.simulation.continuous_report import Tally, Timeline
from server.simulation.continuous_workload import (
    RequestShape,
    WorkloadMix,
    burst_mix,
    parse_tenant_weights,
    poisson_mix,
)
from server.simulation.events import EventHandle, EventLoop
from server.simulation.host import Host, HostConfig
from server.simulation.probe import probe_timing_model
from server.simulation.workload import (
    DEFAULT_MODEL,
    Arrival,
    ArrivalOptions,
    TraceError,
    parse_trace,
)


@cache
def _slo_key(verdict: tuple[str, str]) -> str:
    """A verdict's key in the timeline and the tally, made once per verdict."""
    return "met" if verdict[0] == "met" else f"missed:{verdict[1]}"


@dataclass(slots=True, eq=False)
class _Live:
    """A request not ended yet: its timeline, and what the shell follows while it lives."""

    timeline: Timeline
    targets: SloTargets | None  # an interactive request's targets at its arrival
    stream: _Sent | None  # the bulk stream that sent it, and its number in that stream
    # Once dispatched, its prompt: its first, or that and what it generated before a preemption.
    prompt: Sequence[int] | None = None
    delivered_before: int = 0  # its output tokens when it was last dispatched
    metered: bool = False  # a chat: its gaps feed the bulk controller's meter
    gaps: list[float] | None = None  # its tokens' gaps so far
    last_token_at: float = 0.0
    engine_id: str | None = None  # its current engine request id, while it runs
    deadline: EventHandle | None = None  # its running deadline, while it runs


@dataclass(frozen=True, slots=True)
class BulkStreams:
    """Closed-loop bulk streams: each sends its next request when the previous one ends.
    Their requests are named `{name}{stream}.{number}`, on `model` (another than the
    simulator's `DEFAULT_MODEL`: one of its LoRA adapters)."""

    count: int
    shape: RequestShape
    until_s: float
    tenant: str = "default"
    retry_s: float = 0.1  # after a refusal
    name: str = "bulk"
    model: str = DEFAULT_MODEL


_Sent = tuple[BulkStreams, int, int]  # streams, stream, number in that stream


class ContinuousSimulation:
    """Every request's timeline is kept in `timelines` unless `keep_timelines` is False (a
    million requests); the summary's figures are tallied as each request ends either way.
    `adapters`: the LoRA adapters the engine serves from the start, which the calibration
    times as the server's does (it serves any other too, whose chats keep the base model's
    targets)."""

    def __init__(
        self,
        config: SluiceConfig,
        sim: SimConfig,
        *,
        host: HostConfig | None = None,
        keep_timelines: bool = True,
        adapters: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.loop = EventLoop()
        self.model = SimTimingModel(sim, report_tokens=False)  # it reads no step's tokens
        self.host = Host(host or HostConfig())
        self.core = SchedulerCore(
            config,
            BudgetLimits.from_engine(config.budgets, sim.model_info(DEFAULT_MODEL)),
        )
        if config.estimates.calibrate:
            seed(
                self.core.estimates,
                probe_timing_model(
                    sim, max_sequences=self.core.ledger.limits.sequences, adapters=adapters
                ),
            )
        self.timelines: dict[str, Timeline] = {}
        self.tally = Tally()  # of the requests that ended
        self.peak_budget_in_use = dict.fromkeys(self.core.ledger.in_use(), 0)
        self._keep_timelines = keep_timelines
        self._live: dict[str, _Live] = {}  # requests not ended yet
        self._by_engine_id: dict[str, _Live] = {}  # running requests by engine request id
        self._class_deadline_s = {tc: config.classes[tc].deadline_s for tc in TrafficClass}
        self._class_name = {tc: tc.value for tc in TrafficClass}
        self._stepping = False
        self._engine_free_at = 0.0  # the engine waits for the host's loop until then
        self._wakeup: EventHandle | None = None

    # --- inputs ------------------------------------------------------------------------
    def add_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        """Arrivals in any order from a sequence; an iterator must yield them in time order,
        and is read only as the simulation reaches each."""
        if isinstance(arrivals, Sequence):
            arrivals = sorted(arrivals, key=lambda a: a.time_s)  # stable: ties keep their order
        self.loop.feed(((a.time_s, a) for a in arrivals), self._arrive)

    def add_bulk_streams(self, streams: BulkStreams) -> None:
        """Start closed-loop streams (several sets, each of its own name, may run)."""
        for n in range(streams.count):
            self.loop.call_at(0.0, partial(self._next_in_stream, streams, n, 0))

    def _next_in_stream(self, streams: BulkStreams, stream: int, sequence: int) -> None:
        now = self.loop.now
        if now >= streams.until_s:
            return
        shape = streams.shape
        self._arrive(
            Arrival(
                f"{streams.name}{stream}.{sequence}",
                now,
                None if shape.deadline_s is None else now + shape.deadline_s,
                BULK,
                streams.tenant,
                shape.prompt_tokens,
                shape.max_tokens,
                streams.model,
            ),
            (streams, stream, sequence),
        )

    def cancel_at(self, request_id: str, time_s: float) -> None:
        self.loop.call_at(time_s, partial(self._cancel, request_id))

    def run(self, until: float | None = None) -> None:
        self.loop.run(until)

    def figures(self) -> Tally:
        """The tally of every request so far, those not ended yet as they stand."""
        live = [entry.timeline for entry in self._live.values()]
        return self.tally.with_added(live) if live else self.tally

    # --- events ------------------------------------------------------------------------
    def _arrive(self, arrival: Arrival, stream: _Sent | None = None) -> None:
        """An arrival reaches the scheduler once the host's server has read it."""
        now = self.loop.now
        setup = self.host.request_s(now)
        if setup:
            self.loop.call_later(setup, partial(self._submit, arrival, stream, now))
        else:
            self._submit(arrival, stream, now)

    def _submit(self, arrival: Arrival, stream: _Sent | None, arrived: float) -> None:
        now = self.loop.now
        tc = arrival.traffic_class
        deadline = arrival.deadline_s
        if deadline is None:
            deadline = arrived + self._class_deadline_s[tc]
        ticket = Ticket(
            arrival.id,
            arrival.tenant,
            tc,
            arrival.model,
            arrived,
            deadline,
            arrival.prompt_tokens,
            arrival.max_tokens,
            adapter=None if arrival.model == DEFAULT_MODEL else arrival.model,
        )
        timeline = Timeline(arrival.id, arrival.tenant, self._class_name[tc], arrived, deadline)
        if self._keep_timelines:
            self.timelines[arrival.id] = timeline
        decision = self.core.submit(ticket, now)
        if isinstance(decision, Rejected):  # it never lives, and its verdict reads no targets
            timeline.reason = decision.reason
            self._close(timeline, "rejected", None, None, None, stream)
            return
        # The targets at its arrival: admitting one is no observation, and moves none.
        live = _Live(timeline, self.core.targets_for(ticket), stream)
        live.metered = tc is INTERACTIVE and live.targets is not None
        self._live[arrival.id] = live
        self._dispatch()

    def _dispatch(self) -> None:
        now = self.loop.now
        core = self.core
        started = False
        while True:
            step = core.poll(now)
            for ticket in step.started:
                self._start(ticket, now)
                started = True
            for ticket in step.expired:
                self._end(self._live[ticket.request_id], "expired", "queued")
            for ticket in step.preempted:
                self._preempt(ticket.request_id)  # requeued at once: poll again
            if not step.preempted:
                break
        if started:  # only a start takes budget: without one, nothing passed its peak
            peak = self.peak_budget_in_use
            for name, value in core.ledger.in_use().items():
                if value > peak[name]:
                    peak[name] = value
        self._arm_wakeup(step.wake_at)
        if not self._stepping and self.model.has_work:
            self._stepping = True
            if self._engine_free_at > now:  # still waiting for the loop's CPU
                self.loop.call_at(self._engine_free_at, self._step)
            else:
                self._step()

    def _start(self, ticket: Ticket, now: float) -> None:
        rid = ticket.request_id
        live = self._live[rid]
        timeline = live.timeline
        engine_id = rid if timeline.preemptions == 0 else f"{rid}~{timeline.preemptions}"
        live.engine_id = engine_id
        self._by_engine_id[engine_id] = live
        prompt = live.prompt
        seed = None  # a continuation's tokens are seeded by its engine id
        if prompt is None:  # its own prompt, so that the engine's prefix cache is honest
            # Its first dispatch runs under its own id: the hash that places its prompt is the
            # seed the engine would take from that id (hashed once, not twice).
            seed = stable_hash(rid)
            prompt = live.prompt = self._prompt(seed, ticket.prompt_tokens)
        assert len(prompt) == ticket.prompt_tokens
        live.delivered_before = timeline.output_tokens
        self.model.add(  # (it copies the prompt)
            engine_id, prompt, ticket.max_tokens, ignore_eos=True, seed=seed, adapter=ticket.adapter
        )
        if timeline.dispatched is None:
            timeline.dispatched = now
        timeline.outcome = "running"
        deadline = ticket.deadline if ticket.deadline > now else now
        live.deadline = self.loop.call_at(deadline, partial(self._running_deadline, live))

    def _prompt(self, request_hash: int, length: int) -> Sequence[int]:
        """A request's prompt: consecutive ids from where its id's hash places it (the engine
        copies it into its own list: no list of our own where a range says it)."""
        first = len(SPECIAL_TOKENS)
        span = self.model.config.vocab_size - first
        start = request_hash % span
        if start + length <= span:  # no wrap: a run of consecutive ids
            return range(first + start, first + start + length)
        # Wrapped: the ids from `start` round the span, as many times as it takes (a long
        # prompt on a small vocabulary), repeated and cut as lists are, not id by id.
        ids = range(first, first + span)
        turn = [*ids[start:], *ids[:start]]
        return (turn * -(-length // span))[:length]

    def _stop_engine_request(self, live: _Live) -> None:
        assert live.engine_id is not None
        del self._by_engine_id[live.engine_id]
        self.model.abort(live.engine_id)
        live.engine_id = None

    def _stop_deadline(self, live: _Live) -> None:
        assert live.deadline is not None
        live.deadline.cancel()
        live.deadline = None

    def _preempt(self, request_id: str) -> None:
        live = self._live[request_id]
        assert live.engine_id is not None
        if not self.model.holds(live.engine_id):
            return  # it finished in the step under way: its delivery ends it, as named
        self._stop_deadline(live)
        # A continuation's prompt is its last prompt and the tokens delivered since: outputs of
        # a step still running are dropped, though the engine has sampled them.
        assert live.prompt is not None and live.engine_id is not None
        delivered = live.timeline.output_tokens - live.delivered_before
        live.prompt = self.model.token_ids(live.engine_id)[: len(live.prompt) + delivered]
        self._stop_engine_request(live)
        self.core.requeue(request_id, self.loop.now)
        live.timeline.outcome = "queued"
        live.timeline.preemptions += 1

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
        duration = self.host.step_s(result.duration_s, self.loop.now)
        self.loop.call_later(duration, partial(self._deliver, result))

    def _deliver(self, result: StepResult) -> None:
        """A step's outputs: the core learns of them at once; each reaches its client when the
        host's loop writes it (at once, with no loop cost), which is what chats measure."""
        now = self.loop.now
        by_engine_id = self._by_engine_id
        outputs: list[tuple[str, int, bool]] = []  # for the core, in one call
        completed: list[_Live] = []
        written, event_s, self._engine_free_at = self.host.write(len(result.request_ids), now)
        meter = self.core.meter
        for engine_id, reason in zip(result.request_ids, result.finish_reasons, strict=True):
            written += event_s
            live = by_engine_id.get(engine_id)
            if live is None:
                continue  # aborted while the step ran: a late output revives nothing
            timeline = live.timeline
            # One token per output: its gap is the time since the last.
            if timeline.first_token is None:
                timeline.first_token = written
            else:
                gap = written - live.last_token_at
                if live.gaps is None:
                    live.gaps = [gap]
                else:
                    live.gaps.append(gap)
                if live.metered:
                    assert live.targets is not None
                    meter.gap(gap / live.targets.itl_s, written)
            live.last_token_at = written
            timeline.output_tokens += 1
            if reason is None:
                outputs.append((timeline.id, 1, False))
                continue
            outputs.append((timeline.id, 1, True))
            self._stop_deadline(live)
            del by_engine_id[engine_id]
            live.engine_id = None
            completed.append(live)
        self.core.generated_many(outputs, now)
        for live in completed:
            self._end(live, "completed", None)
        self._stepping = False
        self._dispatch()

    def _running_deadline(self, live: _Live) -> None:
        live.deadline = None
        self._abort_running(live, "expired")

    def _abort_running(self, live: _Live, outcome: str) -> None:
        self._stop_engine_request(live)
        self.core.release(live.timeline.id, self.loop.now)
        self._end(live, outcome, "running")
        self._dispatch()

    def _cancel(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return  # not arrived yet, or ended
        if live.timeline.outcome == "running":
            self._stop_deadline(live)
            self._abort_running(live, "cancelled")
            return
        self.core.release(request_id, self.loop.now)
        self._end(live, "cancelled", "queued")
        self._dispatch()

    def _end(self, live: _Live, outcome: str, stage: str | None) -> None:
        del self._live[live.timeline.id]
        self._close(live.timeline, outcome, stage, live.gaps, live.targets, live.stream)

    def _close(
        self,
        timeline: Timeline,
        outcome: str,
        stage: str | None,
        gaps: list[float] | None,
        targets: SloTargets | None,
        stream: _Sent | None,
    ) -> None:
        """A request ends: its verdict, its figures in the tally, and its stream's next."""
        now = self.loop.now
        timeline.outcome, timeline.stage, timeline.finished = outcome, stage, now
        if gaps:
            timeline.median_gap = statistics.median(gaps)
        ttft = None if timeline.first_token is None else timeline.first_token - timeline.arrival
        verdict = slo_result(
            outcome,
            timeline.reason is not None and REFUSALS[timeline.reason].capacity,
            now - timeline.arrival,
            ttft,
            timeline.median_gap,
            targets,
        )
        timeline.slo = None if verdict is None else _slo_key(verdict)
        if verdict is not None and targets is not None and timeline.traffic_class == "interactive":
            self.core.meter.ended(Ended.of(targets, median_gap_s=timeline.median_gap))
        self.tally.add(timeline)
        if stream is not None:
            streams, number, sequence = stream
            delay = streams.retry_s if outcome == "rejected" else 0.0
            self.loop.call_at(
                now + delay, partial(self._next_in_stream, streams, number, sequence + 1)
            )


# --- reporting ---------------------------------------------------------------------------
def summarize(simulation: ContinuousSimulation, wall_s: float) -> dict[str, Any]:
    """The report: every request's figures (those not ended yet as they stand), the budgets,
    the SLO targets and the bulk cap at the end."""
    figures = simulation.figures().summary()
    targets = simulation.core.bulk_cap.targets()
    return {
        "requests": figures["requests"],
        "virtual_seconds": figures["virtual_seconds"],
        "wall_seconds": round(wall_s, 3),
        "classes": figures["classes"],
        "completed_tokens_by_tenant": figures["completed_tokens_by_tenant"],
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
    host = simulate_parser.add_argument_group("the host around the sim engine (--mode continuous)")
    add_arguments(host, HostConfig, prefix="host")


def build_arrivals(
    arrivals: ArrivalOptions, options: ContinuousOptions
) -> list[Arrival] | Iterator[Arrival]:
    """A trace's arrivals, or generated ones, lazily."""
    if arrivals.arrivals:
        return parse_trace(arrivals.arrivals)
    mix = workload_mix(arrivals, options)
    if arrivals.workload == "bursts":
        return burst_mix(arrivals.rate, arrivals.duration, options.burst_size, mix, arrivals.seed)
    return poisson_mix(arrivals.rate, arrivals.duration, mix, arrivals.seed)


def workload_mix(arrivals: ArrivalOptions, options: ContinuousOptions) -> WorkloadMix:
    workload = arrivals.workload or "poisson"
    share = options.interactive_share
    if share is None:
        share = 0.5 if workload == "mixed" else 1.0
    tenants = options.tenants or ("flood=9,steady=1" if workload == "mixed" else "default")
    relative = arrivals.deadline_s
    return WorkloadMix(
        interactive_share=share,
        tenants=parse_tenant_weights(tenants),
        interactive=RequestShape(options.prompt_tokens, options.max_tokens, relative),
        bulk=RequestShape(options.bulk_prompt_tokens, options.bulk_max_tokens, relative),
    )


def arrival_tenants(arrivals: ArrivalOptions, options: ContinuousOptions) -> set[str]:
    """The tenants the arrivals name: a light tenant of generated load may draw none in a short
    run. Generated arrivals are read (again, from the same seed) only until each of the mix's
    tenants has been seen."""
    given = build_arrivals(arrivals, options)
    if isinstance(given, list):
        return {a.tenant for a in given}
    every = len(workload_mix(arrivals, options).tenants)
    seen: set[str] = set()
    for arrival in given:
        seen.add(arrival.tenant)
        if len(seen) == every:
            break
    return seen


def with_tenants(config: SluiceConfig, names: Iterable[str]) -> SluiceConfig:
    """Make every simulated tenant a configured one, so per-tenant rules apply to it."""
    tenants = dict(config.tenants)
    for name in sorted(names):  # (a set's order changes with the hash seed: runs would differ)
        tenants.setdefault(name, TenantConfig(name=name))
    if len(tenants) > 1 and config.is_open and "default" not in names:
        tenants.pop("default", None)
    return config.model_copy(update={"tenants": tenants})


def run(
    arrivals: ArrivalOptions,
    options: ContinuousOptions,
    sim: SimConfig,
    host: HostConfig,
    *,
    as_json: bool = False,
) -> int:
    """`sluice simulate --mode continuous`, its flags read (`server/cli.py`)."""
    try:
        tenants = arrival_tenants(arrivals, options)
        trace = build_arrivals(arrivals, options)
    except (TraceError, ValueError) as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 2
    config = with_tenants(load_config(options.config), tenants or {"default"})
    simulation = ContinuousSimulation(config, sim, host=host, keep_timelines=as_json)
    simulation.add_arrivals(trace)
    if options.bulk_streams:
        simulation.add_bulk_streams(
            BulkStreams(
                options.bulk_streams,
                RequestShape(options.bulk_prompt_tokens, options.bulk_max_tokens, None),
                until_s=arrivals.duration,
                tenant=next(iter(config.tenants)),
            )
        )
    for item in arrivals.cancel:
        rid, _, at = item.partition("@")
        simulation.cancel_at(rid, float(at) / 1000.0)
    started = time.perf_counter()
    simulation.run()
    summary = summarize(simulation, time.perf_counter() - started)
    if as_json:
        timelines = [asdict(t) for t in simulation.timelines.values()]
        json.dump({"summary": summary, "requests": timelines}, sys.stdout)
        print()
    else:
        print(json.dumps(summary, indent=2))
    return 0
