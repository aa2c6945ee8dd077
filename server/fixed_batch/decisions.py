"""What the batch dispatcher decides, as plain values its shells act on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from server.scheduler.types import RejectReason, Ticket


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Times in seconds on the shell's clock. `workers[i]` is the model worker i holds."""

    workers: tuple[str, ...]
    batch_time_s: float = 0.1
    max_batch: int = 32
    max_delay_s: float = 0.010
    max_queue: int = 10_000
    max_attempts: int | None = None
    lease_s: float | None = None

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("at least one worker is needed")
        if self.batch_time_s <= 0 or self.max_batch < 1 or self.max_delay_s < 0:
            raise ValueError("batch_time_s > 0, max_batch >= 1 and max_delay_s >= 0 required")

    @property
    def attempt_budget(self) -> int:
        """Dispatches allowed per request: enough to bisect a full batch down to one, + 2."""
        if self.max_attempts is not None:
            return self.max_attempts
        return math.ceil(math.log2(self.max_batch)) + 3

    @property
    def lease_timeout_s(self) -> float:
        """A batch not reported by start + this is presumed lost with its worker."""
        return self.lease_s if self.lease_s is not None else 3 * self.batch_time_s


class BatchOutcome(StrEnum):
    COMPLETED = "completed"
    REJECTED = "rejected"
    EXPIRED = "expired"
    FAILED = "failed"
    CANCELLED = "cancelled"


class CancelStage(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Run `tickets` as one batch on `worker_id`; `lease_id` is every member's attempt id."""

    worker_id: int
    lease_id: int
    model: str
    tickets: list[Ticket]
    started: float
    expected_finish: float
    retry: bool = False

    @property
    def attempt_id(self) -> int:
        return self.lease_id


@dataclass(frozen=True, slots=True)
class Ended:
    """A request that ended without a result (expired or failed)."""

    ticket: Ticket
    outcome: BatchOutcome
    reason: str


@dataclass(slots=True)
class BatchStep:
    """What `poll` decided at one instant."""

    dispatches: list[Dispatch] = field(default_factory=list)
    ended: list[Ended] = field(default_factory=list)
    lost_workers: list[int] = field(default_factory=list)
    retried: list[Ticket] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BatchCompletion:
    delivered: list[Ticket]
    discarded: list[tuple[str, int]]
    worker_freed: bool


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    lease_id: int | None
    retried: list[Ticket]
    ended: list[Ended]


__all__ = [
    "BatchCompletion",
    "BatchConfig",
    "BatchOutcome",
    "BatchStep",
    "CancelStage",
    "Dispatch",
    "Ended",
    "FailureOutcome",
    "RejectReason",
]
