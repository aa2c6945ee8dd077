"""Batch mode's part of the `sluice` command: serve flags, `simulate --mode batch`, `plan`.

`server/cli.py` owns the parser, with the simulate flags both modes share, and calls these
hooks.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine_adapters.sim_batch import DEFAULT_POISON_MARKER, BatchModel, SimBatchEngine
from server.core.settings import add_arguments
from server.core.stats import quantile
from server.fixed_batch.decisions import BatchConfig
from server.fixed_batch.plan import format_plan, latencies_ms, plan
from server.fixed_batch.runtime import BatchRuntime
from server.fixed_batch.simulate import Faults, SimResult, simulate
from server.observability.metrics import Metrics
from server.simulation.workload import (
    DEFAULT_MODEL,
    Arrival,
    ArrivalOptions,
    TraceError,
    parse_trace,
    poisson_arrivals,
)

_TIMELINE_LIMIT = 200


class BatchShape(BaseModel):
    """The flags of the batch engine's shape, for `serve --engine sim-batch` and `simulate
    --mode batch`."""

    model_config = ConfigDict(frozen=True)

    workers: int = Field(1, description="batch workers (one batch at a time each)")
    batch_ms: float = Field(100.0, description="fixed time of one batch")
    max_batch: int = Field(32, description="most requests in one batch")
    max_delay_ms: float = Field(
        10.0, description="longest a partial batch waits for company once a worker is free"
    )
    max_queue: int = Field(10_000, description="queued requests per model, at most")
    attempts: int | None = Field(
        None, description="dispatches allowed per request (default: ceil(log2(max-batch)) + 3)"
    )
    lease_ms: float | None = Field(
        None,
        description="a batch unanswered this long after it started is presumed lost "
        "(default: 3 x batch-ms)",
    )
    poison_marker: str = Field(
        DEFAULT_POISON_MARKER,
        description="a prompt containing this text crashes its batch (failure injection)",
    )
    batch_fail_rate: float = Field(
        0.0, description="probability that any batch crashes its worker (failure injection)"
    )

    def config(self, workers: tuple[str, ...]) -> BatchConfig:
        """The scheduler's configuration for this shape, with `workers` (a model per worker)."""
        return BatchConfig(
            workers=workers,
            batch_time_s=self.batch_ms / 1000,
            max_batch=self.max_batch,
            max_delay_s=self.max_delay_ms / 1000,
            max_queue=self.max_queue,
            max_attempts=self.attempts,
            lease_s=None if self.lease_ms is None else self.lease_ms / 1000,
        )


class BatchFaults(BaseModel):
    """The flags of `simulate --mode batch` beside the shape: models and injected faults."""

    models: str | None = Field(
        None,
        description="workers per model version, e.g. 'a=2,b=1' (overrides --workers)",
        json_schema_extra={"metavar": "MODEL=N,..."},
    )
    poison_rate: float = Field(
        0.0, description="fraction of generated arrivals whose prompt carries the poison marker"
    )
    kill: list[str] = Field(
        [],
        description="the worker dies at this time, mid-batch if busy (repeatable)",
        json_schema_extra={"metavar": "WORKER@MS"},
    )
    hang: list[str] = Field(
        [],
        description="the worker's next batch from this time answers only after --hang-ms",
        json_schema_extra={"metavar": "WORKER@MS"},
    )
    hang_ms: float = Field(1000.0, description="how late a hung batch answers")
    restart_ms: float = Field(0.0, description="time for a lost worker to return")


def add_serve_arguments(serve_parser: argparse.ArgumentParser) -> None:
    add_arguments(serve_parser.add_argument_group("batch engine (--engine sim-batch)"), BatchShape)


def build_serving(
    shape: BatchShape, served_model_name: str | None, metrics: Metrics
) -> tuple[SimBatchEngine, BatchRuntime, str]:
    """What `serve --engine sim-batch` runs: (engine, its batch runtime as the dispatcher,
    served model name). Batch mode's queue bound is --max-queue for now, not the per-class
    limits."""
    name = served_model_name or DEFAULT_MODEL
    config = shape.config((name,) * shape.workers)
    model = BatchModel(config.batch_time_s, config.max_batch, shape.poison_marker or None)
    engine = SimBatchEngine(model, name=name, fail_rate=shape.batch_fail_rate)
    return engine, BatchRuntime(config, engine, metrics), name


def add_simulate_arguments(simulate_parser: argparse.ArgumentParser) -> None:
    group = simulate_parser.add_argument_group("batch mode (--mode batch)")
    add_arguments(group, BatchShape)
    add_arguments(group, BatchFaults)


class PlanOptions(BaseModel):
    """The flags of `sluice plan`."""

    model_config = ConfigDict(frozen=True)

    rate: float = Field(description="arrivals per second")
    batch_ms: float = 100.0
    max_batch: int = 32
    max_delay_ms: float = 10.0
    p99_ms: float = Field(200.0, description="p99 latency target")
    duration: float = Field(30.0, description="simulated seconds per candidate")
    candidates: int = Field(3, description="worker counts to simulate")
    seed: int = 0


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="workers needed for a fixed-time batch engine",
        description="Capacity arithmetic for a fixed-time batch engine, then simulated latency "
        "percentiles for each candidate worker count under Poisson arrivals.",
    )
    add_arguments(p, PlanOptions)
    p.add_argument("--json", action="store_true")


def run_plan(options: PlanOptions, *, as_json: bool = False) -> int:
    result = plan(
        options.rate,
        batch_ms=options.batch_ms,
        max_batch=options.max_batch,
        max_delay_ms=options.max_delay_ms,
        p99_target_ms=options.p99_ms,
        duration_s=options.duration,
        seed=options.seed,
        candidates=options.candidates,
    )
    print(json.dumps(result.to_json(), indent=2) if as_json else format_plan(result))
    return 0


def batch_config(shape: BatchShape, faults: BatchFaults) -> BatchConfig:
    models = _parse_models(faults.models) if faults.models else None
    return shape.config(models or (DEFAULT_MODEL,) * shape.workers)


def run_simulate(
    arrivals: ArrivalOptions, shape: BatchShape, faults: BatchFaults, *, as_json: bool = False
) -> int:
    """`sluice simulate --mode batch`, its flags read (`server/cli.py`)."""
    try:
        config = batch_config(shape, faults)
        trace = _arrivals(arrivals, shape, faults)
        injected = Faults(
            kills=tuple(_worker_at(k) for k in faults.kill),
            hangs=tuple(_worker_at(h) for h in faults.hang),
            hang_s=faults.hang_ms / 1000,
            cancels=tuple(_id_at(c) for c in arrivals.cancel),
            fail_rate=shape.batch_fail_rate,
            restart_s=faults.restart_ms / 1000,
            seed=arrivals.seed,
        )
        model = BatchModel(config.batch_time_s, config.max_batch, shape.poison_marker or None)
    except (TraceError, ValueError) as exc:
        print(f"sluice simulate: {exc}")
        return 2
    small = arrivals.arrivals is not None
    result = simulate(config, trace, faults=injected, model=model, keep_batches=small)
    if as_json:
        print(json.dumps(result_json(result)))
    else:
        print(format_result(result, timeline=small))
    return 0


def _arrivals(
    arrivals: ArrivalOptions, shape: BatchShape, faults: BatchFaults
) -> Iterable[Arrival]:
    if arrivals.arrivals is not None:
        return parse_trace(arrivals.arrivals)
    if arrivals.workload != "poisson":
        raise ValueError("--mode batch needs --arrivals or --workload poisson")
    generated = poisson_arrivals(
        arrivals.rate,
        arrivals.duration,
        seed=arrivals.seed,
        relative_deadline_s=arrivals.deadline_s,
    )
    if faults.poison_rate > 0:
        return _with_poison(generated, faults.poison_rate, shape.poison_marker, arrivals.seed)
    return generated


def _with_poison(
    arrivals: Iterable[Arrival], rate: float, marker: str, seed: int
) -> Iterator[Arrival]:
    rng = random.Random(seed + 1)
    for arrival in arrivals:
        yield replace(arrival, prompt=marker) if rng.random() < rate else arrival


def _parse_models(text: str) -> tuple[str, ...]:
    workers: list[str] = []
    for item in text.split(","):
        name, _, count = item.strip().partition("=")
        if not name or not count.isdigit():
            raise ValueError(f"expected MODEL=N in --models, got {item!r}")
        workers.extend([name] * int(count))
    return tuple(workers)


def _worker_at(text: str) -> tuple[int, float]:
    worker, _, ms = text.partition("@")
    return int(worker), float(ms) / 1000


def _id_at(text: str) -> tuple[str, float]:
    rid, _, ms = text.partition("@")
    return rid, float(ms) / 1000


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isinf(seconds) else round(seconds * 1000, 3)


def result_json(result: SimResult) -> dict[str, Any]:
    return {
        "requests": [
            {
                "id": r.id,
                "arrival_ms": _ms(r.arrival),
                "deadline_ms": _ms(r.deadline),
                "dispatch_ms": _ms(r.dispatch),
                "finish_ms": _ms(r.finish),
                "ended_ms": _ms(r.ended),
                "outcome": None if r.outcome is None else str(r.outcome),
                "worker": r.worker,
                "attempts": r.attempts,
                "reason": r.reason,
            }
            for r in result.requests
        ],
        "batches": [
            {
                "lease": b.lease_id,
                "worker": b.worker,
                "size": b.size,
                "start_ms": _ms(b.start),
                "end_ms": _ms(b.end),
                "status": b.status,
                "retry": b.retry,
            }
            for b in result.batches
        ],
        "summary": summary(result),
    }


def summary(result: SimResult) -> dict[str, Any]:
    outcomes: dict[str, int] = {}
    for r in result.requests:
        key = str(r.outcome)
        outcomes[key] = outcomes.get(key, 0) + 1
    lat = latencies_ms(result)
    return {
        "requests": len(result.requests),
        "outcomes": outcomes,
        "batches": result.batch_count,
        "mean_batch_size": round(result.mean_batch_size, 2),
        "latency_ms": {f"p{q}": _round(quantile(lat, q / 100)) for q in (50, 90, 99, 99.9)},
        "discarded_results": result.discarded_results,
        "duplicate_deliveries": result.duplicate_deliveries,
        "end_ms": _ms(result.end_time),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def format_result(result: SimResult, *, timeline: bool) -> str:
    lines: list[str] = []
    if timeline:
        events: list[tuple[float, int, str]] = []
        for r in result.requests:
            events.append((r.arrival, 0, f"{r.id} arrives"))
            if r.outcome in ("rejected", "expired", "failed", "cancelled") and r.ended is not None:
                events.append((r.ended, 2, f"{r.id} {r.outcome}: {r.reason or ''}".rstrip(": ")))
        for b in result.batches:
            size = f"{b.size} request{'s' * (b.size != 1)}"
            retry = " [retry]" if b.retry else ""
            events.append(
                (b.start, 1, f"worker {b.worker} starts batch {b.lease_id} ({size}){retry}")
            )
            if b.end is not None:
                events.append((b.end, 1, f"worker {b.worker} batch {b.lease_id} {b.status}"))
        for r in result.requests:
            if r.finish is not None:
                events.append(
                    (r.finish, 3, f"{r.id} completes after {(r.finish - r.arrival) * 1000:g} ms")
                )
        events.sort(key=lambda e: (e[0], e[1]))
        for at, _, text in events[:_TIMELINE_LIMIT]:
            lines.append(f"{at * 1000:10.3f} ms  {text}")
        if len(events) > _TIMELINE_LIMIT:
            lines.append(f"... {len(events) - _TIMELINE_LIMIT} more events")
    s = summary(result)
    outcome_text = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items()))
    pct = ", ".join(f"{k} {v if v is None else f'{v:g}'} ms" for k, v in s["latency_ms"].items())
    lines += [
        f"requests: {s['requests']} ({outcome_text})",
        f"batches: {s['batches']}, mean size {s['mean_batch_size']:g}",
        f"latency of completed requests: {pct}",
        f"late or stale results discarded: {s['discarded_results']}",
    ]
    return "\n".join(lines)
