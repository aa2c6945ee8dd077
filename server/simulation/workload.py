"""Arrivals for the simulators: explicit traces and generated load.

A trace is a comma-separated list of `ID@MS[:key=value...]`, e.g. "A@0,B@7,E@1:deadline=150".
Times are milliseconds on the simulation clock; `deadline` is absolute on the same clock.
Other keys: `class` (interactive|bulk), `tenant`, `prompt_tokens`, `max_tokens`, `model`,
`prompt` (text the simulated engine sees, e.g. a poison marker). Generated load (Poisson) is
seeded, so a run is reproducible. Arrivals are plain values; shells turn them into tickets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.scheduler.types import TrafficClass

DEFAULT_MODEL = "sluice-demo"
DEFAULT_TENANT = "default"


@dataclass(slots=True)
class Arrival:
    """One request as it reaches the server. Times are seconds on the simulation clock."""

    id: str
    time_s: float
    deadline_s: float | None = None
    traffic_class: TrafficClass = TrafficClass.INTERACTIVE
    tenant: str = DEFAULT_TENANT
    prompt_tokens: int = 16
    max_tokens: int = 16
    model: str = DEFAULT_MODEL
    prompt: str = ""


class ArrivalOptions(BaseModel):
    """`sluice simulate`'s arrivals, in either mode: a trace given, or load generated."""

    model_config = ConfigDict(frozen=True)

    seed: int = 0
    arrivals: str | None = Field(
        None, description='explicit trace, e.g. "A@0,B@7,E@1:deadline=150" (times in ms)'
    )
    workload: Literal["poisson", "bursts", "mixed"] | None = None
    rate: float = Field(100.0, description="arrivals per second")
    duration: float = Field(10.0, description="seconds of generated arrivals")
    deadline_ms: float | None = Field(
        None,
        description="deadline of generated arrivals, relative to their arrival (default: "
        "continuous mode, the class's; batch mode, none)",
    )
    cancel: list[str] = Field(
        [],
        description="the caller of request ID leaves at this time (repeatable)",
        json_schema_extra={"metavar": "ID@MS"},
    )

    @property
    def deadline_s(self) -> float | None:
        return None if self.deadline_ms is None else self.deadline_ms / 1000.0


class TraceError(ValueError):
    """An arrivals trace that cannot be parsed."""


_INT_KEYS = ("prompt_tokens", "max_tokens")
_STR_KEYS = ("tenant", "model", "prompt")


def parse_trace(text: str, *, defaults: Arrival | None = None) -> list[Arrival]:
    """Parse "A@0,B@7,E@1:deadline=150" into arrivals sorted by time (stable for ties)."""
    base = defaults or Arrival(id="", time_s=0.0)
    arrivals = [_parse_item(item.strip(), base) for item in text.split(",") if item.strip()]
    seen: set[str] = set()
    for arrival in arrivals:
        if arrival.id in seen:
            raise TraceError(f"duplicate arrival id {arrival.id!r}")
        seen.add(arrival.id)
    return sorted(arrivals, key=lambda a: a.time_s)


def _parse_item(item: str, base: Arrival) -> Arrival:
    head, *options = item.split(":")
    rid, sep, at = head.partition("@")
    if not sep or not rid:
        raise TraceError(f"expected ID@MS, got {item!r}")
    fields: dict[str, object] = {"id": rid, "time_s": _ms(at, item) / 1000.0}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq:
            raise TraceError(f"expected key=value in {item!r}, got {option!r}")
        if key == "deadline":
            fields["deadline_s"] = _ms(value, item) / 1000.0
        elif key == "class":
            try:
                fields["traffic_class"] = TrafficClass(value)
            except ValueError:
                raise TraceError(f"unknown traffic class {value!r} in {item!r}") from None
        elif key in _INT_KEYS:
            fields[key] = int(_ms(value, item))
        elif key in _STR_KEYS:
            fields[key] = value
        else:
            raise TraceError(f"unknown key {key!r} in {item!r}")
    return replace(base, **fields)  # type: ignore[arg-type]


def _ms(value: str, item: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise TraceError(f"expected a number of ms in {item!r}, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"time must be a finite number >= 0 in {item!r}")
    return number


def poisson_arrivals(
    rate: float,
    duration_s: float,
    *,
    seed: int = 0,
    relative_deadline_s: float | None = None,
    defaults: Arrival | None = None,
    id_prefix: str = "r",
) -> Iterator[Arrival]:
    """Arrivals with exponential gaps (mean 1/rate) from 0 until `duration_s`, lazily."""
    base = defaults or Arrival(id="", time_s=0.0)
    for n, t in enumerate(poisson_times(rate, duration_s, seed=seed)):
        deadline = None if relative_deadline_s is None else t + relative_deadline_s
        yield Arrival(
            f"{id_prefix}{n}",
            t,
            deadline,
            base.traffic_class,
            base.tenant,
            base.prompt_tokens,
            base.max_tokens,
            base.model,
            base.prompt,
        )


def poisson_times(rate: float, duration_s: float, *, seed: int = 0) -> Iterator[float]:
    """The times of `poisson_arrivals`, alone: exponential gaps (mean 1/rate) from 0 until
    `duration_s`, lazily."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    # Each gap as random.expovariate(rate) draws it, -log(1 - U) / rate, without its call (a
    # million arrivals make a million).
    uniform, log = random.Random(seed).random, math.log
    t = -log(1.0 - uniform()) / rate
    while t < duration_s:
        yield t
        t += -log(1.0 - uniform()) / rate
