"""What `sluice simulate --mode continuous` reports: each request's timeline, and per traffic
class the figures of the summary, tallied as each request ends.

A million-request run keeps no per-request object past its end (unless asked for the
timelines): a `Tally` holds counters and, for the percentiles, one array of floats per figure,
sorted once when the summary is made.
"""

from __future__ import annotations

import copy
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.core.stats import nearest_rank
from server.scheduler.types import RejectReason, TrafficClass


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


# The outcome key of each refusal, made once: formatting an enum runs Python code, and most of
# a million overloaded arrivals are refused.
_REJECTED = {reason: f"rejected:{reason}" for reason in RejectReason}


@dataclass(slots=True)
class _ClassTally:
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    slo: dict[str, int] = field(default_factory=dict)
    queue_wait: array[float] = field(default_factory=lambda: array("d"))
    ttft: array[float] = field(default_factory=lambda: array("d"))  # completed only
    latency: array[float] = field(default_factory=lambda: array("d"))  # completed only
    median_gap: array[float] = field(default_factory=lambda: array("d"))  # completed only
    completed_after_deadline: int = 0
    completed_tokens: int = 0
    preemptions: int = 0

    def add(self, t: Timeline) -> None:
        self.requests += 1
        key = t.outcome if t.reason is None else _REJECTED[t.reason]
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if t.slo is not None:
            self.slo[t.slo] = self.slo.get(t.slo, 0) + 1
        if t.dispatched is not None:
            self.queue_wait.append(t.dispatched - t.arrival)
        self.preemptions += t.preemptions
        if t.outcome != "completed":
            return
        if t.first_token is not None:
            self.ttft.append(t.first_token - t.arrival)
        if t.finished is not None:
            self.latency.append(t.finished - t.arrival)
            if t.finished > t.deadline:
                self.completed_after_deadline += 1
        if t.median_gap is not None:
            self.median_gap.append(t.median_gap)
        self.completed_tokens += t.output_tokens

    def summary(self, end: float) -> dict[str, Any]:
        judged = sum(self.slo.values())
        return {
            "requests": self.requests,
            "outcomes": dict(sorted(self.outcomes.items())),
            "queue_wait_ms": percentiles_ms(self.queue_wait),
            "ttft_ms": percentiles_ms(self.ttft),
            "latency_ms": percentiles_ms(self.latency),
            "completed_after_deadline": self.completed_after_deadline,
            "median_gap_ms": percentiles_ms(self.median_gap),
            "tokens_per_s": round(self.completed_tokens / end, 1) if end else 0.0,
            "preemptions": self.preemptions,
            "slo": dict(sorted(self.slo.items())),
            "slo_met_share": round(self.slo.get("met", 0) / judged, 4) if judged else None,
        }


class Tally:
    """The summary's figures over the requests added so far."""

    def __init__(self) -> None:
        self.requests = 0
        self.end = 0.0  # the latest arrival or end
        self._classes = {tc.value: _ClassTally() for tc in TrafficClass}
        self._tenant_tokens: dict[str, int] = {}  # completed requests' output tokens

    def add(self, t: Timeline) -> None:
        self.requests += 1
        end = t.finished or t.arrival
        if end > self.end:
            self.end = end
        self._classes[t.traffic_class].add(t)
        if t.outcome == "completed":
            self._tenant_tokens[t.tenant] = self._tenant_tokens.get(t.tenant, 0) + t.output_tokens

    def with_added(self, timelines: Iterable[Timeline]) -> Tally:
        """A copy, with `timelines` (requests not ended yet) added."""
        tally = copy.deepcopy(self)
        for t in timelines:
            tally.add(t)
        return tally

    def summary(self) -> dict[str, Any]:
        """The requests, the virtual seconds, each class's figures and the tokens by tenant."""
        return {
            "requests": self.requests,
            "virtual_seconds": round(self.end, 3),
            "classes": {tc.value: self._classes[tc.value].summary(self.end) for tc in TrafficClass},
            "completed_tokens_by_tenant": dict(sorted(self._tenant_tokens.items())),
        }


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99 and max of `seconds`, in milliseconds (None for no values)."""
    ordered = sorted(seconds)
    result: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0)):
        result[name] = round(nearest_rank(ordered, q) * 1000, 3) if ordered else None
    return result
