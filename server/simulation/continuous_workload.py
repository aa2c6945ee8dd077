"""Generated load for the continuous simulator: Poisson, bursts, mixed classes and tenants.

Builds on `workload.py` (Arrival, Poisson gaps); this module only decides the shape of each
arrival (class, tenant, token counts, deadline) and groups arrivals into bursts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from server.scheduler.types import BULK, INTERACTIVE
from server.simulation.workload import DEFAULT_MODEL, Arrival, poisson_times


@dataclass(frozen=True, slots=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int
    deadline_s: float | None  # relative to arrival; None: the class default


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    interactive_share: float = 1.0
    tenants: tuple[tuple[str, float], ...] = (("default", 1.0),)  # name, weight
    interactive: RequestShape = RequestShape(64, 32, None)
    bulk: RequestShape = RequestShape(256, 256, None)
    model: str = DEFAULT_MODEL


def parse_tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    """'a=3,b=1' -> (('a', 3.0), ('b', 1.0)); a bare name weighs 1."""
    weights = []
    for item in text.split(","):
        name, _, weight = item.strip().partition("=")
        if not name:
            continue
        value = float(weight) if weight else 1.0
        if value <= 0:
            raise ValueError(f"tenant weight must be > 0 in {item!r}")
        weights.append((name, value))
    if not weights:
        raise ValueError("no tenants given")
    return tuple(weights)


def _shaped(times: Iterator[float], mix: WorkloadMix, seed: int) -> Iterator[Arrival]:
    rng = random.Random(seed + 1)
    names = [name for name, _ in mix.tenants]
    weights = [weight for _, weight in mix.tenants]
    share, model = mix.interactive_share, mix.model
    for n, time_s in enumerate(times):
        interactive = rng.random() < share
        shape = mix.interactive if interactive else mix.bulk
        tenant = names[0] if len(names) == 1 else rng.choices(names, weights)[0]
        yield Arrival(
            f"r{n}",
            time_s,
            None if shape.deadline_s is None else time_s + shape.deadline_s,
            INTERACTIVE if interactive else BULK,
            tenant,
            shape.prompt_tokens,
            shape.max_tokens,
            model,
        )


def poisson_mix(rate: float, duration_s: float, mix: WorkloadMix, seed: int) -> Iterator[Arrival]:
    return _shaped(poisson_times(rate, duration_s, seed=seed), mix, seed)


def burst_mix(
    rate: float, duration_s: float, burst_size: int, mix: WorkloadMix, seed: int
) -> Iterator[Arrival]:
    """Bursts of `burst_size` simultaneous arrivals, bursts themselves Poisson: mean `rate`."""
    bursts = poisson_times(rate / burst_size, duration_s, seed=seed)
    times = (t for burst_time in bursts for t in [burst_time] * burst_size)
    return _shaped(times, mix, seed)
