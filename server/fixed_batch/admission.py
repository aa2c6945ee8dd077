"""Admission rules for batch mode, as small pure functions.

They are separate from the dispatcher so the continuous scheduler can share them: a bounded
queue, and "say no early" when even the most optimistic schedule finishes after the deadline.
"""

from __future__ import annotations

import math

from server.scheduler.types import RejectReason


def queue_has_room(depth: int, limit: int) -> bool:
    return depth < limit


def earliest_finish(now: float, earliest_worker_free: float, service_s: float) -> float:
    """The soonest a request can finish: dispatched the moment a compatible worker frees up."""
    return max(now, earliest_worker_free) + service_s


def deadline_meetable(deadline: float, finish: float) -> bool:
    return finish <= deadline


def latest_start(deadline: float, service_s: float) -> float:
    """The last dispatch time that still finishes by the deadline (inf without one)."""
    return deadline - service_s if math.isfinite(deadline) else math.inf


def admit(
    *,
    now: float,
    deadline: float,
    queue_depth: int,
    queue_limit: int,
    earliest_worker_free: float | None,
    service_s: float,
) -> RejectReason | None:
    """None to admit, else the reason to refuse. `earliest_worker_free` None: no such worker."""
    if earliest_worker_free is None:
        return RejectReason.NO_COMPATIBLE_WORKER
    if not queue_has_room(queue_depth, queue_limit):
        return RejectReason.OVERLOADED
    if math.isfinite(deadline) and not deadline_meetable(
        deadline, earliest_finish(now, earliest_worker_free, service_s)
    ):
        return RejectReason.DEADLINE_UNMEETABLE
    return None
