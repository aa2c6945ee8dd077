"""Capacity planning for fixed-time batch engines: the arithmetic, then the simulator.

The arithmetic gives the ideal per-worker throughput (full batches back to back) and the
minimum worker count; the simulator, under seeded Poisson arrivals, gives what it cannot:
latency percentiles for each candidate worker count and the batch size actually achieved.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from server.core.stats import quantile
from server.fixed_batch.decisions import BatchConfig, BatchOutcome
from server.fixed_batch.simulate import SimResult, simulate
from server.simulation.workload import DEFAULT_MODEL, poisson_arrivals


@dataclass(frozen=True, slots=True)
class Candidate:
    workers: int
    utilization: float  # offered load over ideal capacity
    p50_ms: float | None
    p99_ms: float | None
    mean_batch_size: float
    throughput_rps: float  # completed requests per simulated second
    capacity_at_mean_batch_rps: float  # N workers always busy at the measured batch size
    meets_target: bool


@dataclass(slots=True)
class CapacityPlan:
    rate: float
    batch_ms: float
    max_batch: int
    max_delay_ms: float
    p99_target_ms: float
    per_worker_rps: float
    min_workers: int
    batch_size_table: list[dict[str, float]]
    candidates: list[Candidate] = field(default_factory=list)
    recommended_workers: int | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def per_worker_rps(batch_s: float, batch_size: float) -> float:
    """Throughput of one continuously busy worker at a given batch size."""
    return batch_size / batch_s


def min_workers(rate: float, per_worker: float) -> int:
    """Fewest workers whose ideal capacity covers the rate: rate / per-worker, rounded up."""
    return max(1, math.ceil(rate / per_worker))


def utilization(rate: float, workers: int, per_worker: float) -> float:
    return rate / (workers * per_worker)


def latencies_ms(result: SimResult) -> list[float]:
    return sorted(
        (r.finish - r.arrival) * 1000
        for r in result.requests
        if r.outcome == BatchOutcome.COMPLETED and r.finish is not None
    )


def simulate_candidate(
    workers: int,
    *,
    rate: float,
    batch_s: float,
    max_batch: int,
    max_delay_s: float,
    duration_s: float,
    seed: int,
    p99_target_ms: float,
) -> Candidate:
    config = BatchConfig(
        workers=(DEFAULT_MODEL,) * workers,
        batch_time_s=batch_s,
        max_batch=max_batch,
        max_delay_s=max_delay_s,
        max_queue=10**9,
    )
    result = simulate(config, poisson_arrivals(rate, duration_s, seed=seed), keep_batches=False)
    lat = latencies_ms(result)
    p99 = quantile(lat, 0.99)
    ideal = per_worker_rps(batch_s, max_batch)
    return Candidate(
        workers=workers,
        utilization=round(utilization(rate, workers, ideal), 4),
        p50_ms=_round(quantile(lat, 0.5)),
        p99_ms=_round(p99),
        mean_batch_size=round(result.mean_batch_size, 2),
        throughput_rps=round(len(lat) / result.end_time, 1) if result.end_time else 0.0,
        capacity_at_mean_batch_rps=round(
            workers * per_worker_rps(batch_s, result.mean_batch_size), 1
        ),
        meets_target=p99 is not None and p99 <= p99_target_ms,
    )


def plan(
    rate: float,
    *,
    batch_ms: float = 100.0,
    max_batch: int = 32,
    max_delay_ms: float = 10.0,
    p99_target_ms: float = 200.0,
    duration_s: float = 30.0,
    seed: int = 0,
    candidates: int = 3,
    max_extra: int = 8,
) -> CapacityPlan:
    """Simulate `candidates` worker counts from the minimum up, and more (up to `max_extra`
    above the minimum) until one meets the p99 target."""
    batch_s = batch_ms / 1000
    ideal = per_worker_rps(batch_s, max_batch)
    lowest = min_workers(rate, ideal)
    sizes = sorted({max_batch, max(1, max_batch // 2), max(1, max_batch // 4)}, reverse=True)
    table = [
        {
            "batch_size": s,
            "per_worker_rps": per_worker_rps(batch_s, s),
            "min_workers": min_workers(rate, per_worker_rps(batch_s, s)),
        }
        for s in sizes
    ]
    result = CapacityPlan(
        rate, batch_ms, max_batch, max_delay_ms, p99_target_ms, ideal, lowest, table
    )
    for workers in range(lowest, lowest + max_extra + 1):
        if workers >= lowest + candidates and result.recommended_workers is not None:
            break
        candidate = simulate_candidate(
            workers,
            rate=rate,
            batch_s=batch_s,
            max_batch=max_batch,
            max_delay_s=max_delay_ms / 1000,
            duration_s=duration_s,
            seed=seed,
            p99_target_ms=p99_target_ms,
        )
        result.candidates.append(candidate)
        if candidate.meets_target and result.recommended_workers is None:
            result.recommended_workers = workers
    return result


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def format_plan(p: CapacityPlan) -> str:
    lines = [
        f"Offered load {p.rate:g} req/s; batch {p.batch_ms:g} ms, up to {p.max_batch} "
        f"requests; batching delay {p.max_delay_ms:g} ms; p99 target {p.p99_target_ms:g} ms",
        f"Ideal per-worker throughput: {p.max_batch} / {p.batch_ms / 1000:g} s = "
        f"{p.per_worker_rps:g} req/s",
        f"Minimum workers: {p.min_workers} (ceil({p.rate:g} / {p.per_worker_rps:g}))",
        "If batches are not full (same fixed batch time):",
    ]
    for row in p.batch_size_table:
        lines.append(
            f"  average batch {row['batch_size']:g}: {row['per_worker_rps']:g} "
            f"req/s per worker, {row['min_workers']:g} workers minimum"
        )
    lines.append("Simulated (Poisson arrivals):")
    lines.append("  workers  utilization  p50 ms   p99 ms   mean batch  capacity@mean batch")
    for c in p.candidates:
        mark = " <- meets target" if c.workers == p.recommended_workers else ""
        lines.append(
            f"  {c.workers:7d}  {c.utilization:10.1%}  {_fmt(c.p50_ms)}  {_fmt(c.p99_ms)}  "
            f"{c.mean_batch_size:10.2f}  {c.capacity_at_mean_batch_rps:10.1f} req/s{mark}"
        )
    rec = p.recommended_workers
    lines.append(
        f"Recommended: {rec} workers"
        if rec is not None
        else "No candidate met the p99 target; raise --p99-ms or the worker range."
    )
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return f"{value:7.1f}" if value is not None else "      -"
