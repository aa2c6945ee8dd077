"""Small builders shared by the batch-mode tests."""

from __future__ import annotations

import math

from server.fixed_batch.decisions import BatchConfig
from server.scheduler.types import Ticket, TrafficClass

MODEL = "sluice-demo"


def exercise_config(**overrides: object) -> BatchConfig:
    """The design problem's exercise: one worker, batches of four, 10 ms delay, 100 ms."""
    values: dict[str, object] = {
        "workers": (MODEL,),
        "batch_time_s": 0.1,
        "max_batch": 4,
        "max_delay_s": 0.010,
    }
    values.update(overrides)
    return BatchConfig(**values)  # type: ignore[arg-type]


def ticket(
    request_id: str, arrival: float, *, deadline: float = math.inf, model: str = MODEL
) -> Ticket:
    return Ticket(
        request_id=request_id,
        tenant="default",
        traffic_class=TrafficClass.INTERACTIVE,
        model=model,
        arrival=arrival,
        deadline=deadline,
        prompt_tokens=8,
        max_tokens=4,
    )


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 6)
