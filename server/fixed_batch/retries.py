"""Retries after a failed batch, each bounded: one broken request gets no endless chances.

A batch that failed is retried whole once; a batch that fails again is split in halves, until
the request that crashes it runs alone and, crashing it again, fails. Each retry is within the
request's attempt budget and its deadline.
"""

from __future__ import annotations

from server.fixed_batch.decisions import BatchOutcome
from server.fixed_batch.queues import LiveRequest


class Retries:
    def __init__(self, attempt_budget: int) -> None:
        self.attempt_budget = attempt_budget

    def regroup(self, crashed: list[LiveRequest]) -> list[list[LiveRequest]] | None:
        """The groups to retry of a batch whose unanswered members are `crashed`: whole the
        first time, in halves after. None: a request that crashed its batch again alone is the
        culprit, and fails."""
        first_failure = all(m.crashes == 0 for m in crashed)
        for m in crashed:
            m.crashes += 1
            m.attempt_id = -1
        if len(crashed) == 1 and crashed[0].crashes >= 2:
            return None
        if first_failure or len(crashed) == 1:
            return [crashed]
        half = (len(crashed) + 1) // 2
        return [crashed[:half], crashed[half:]]

    @staticmethod
    def culprit_reason(live: LiveRequest) -> str:
        return f"request crashed its batch {live.crashes} times, the last time alone"

    def refusal(self, live: LiveRequest, start: float) -> tuple[BatchOutcome, str] | None:
        """Why `live` may not be retried if its retry can start at `start`; None: it may."""
        if live.attempts >= self.attempt_budget:
            return BatchOutcome.FAILED, f"attempt budget of {self.attempt_budget} exhausted"
        if live.latest_start < start:
            return BatchOutcome.EXPIRED, "deadline cannot be met by a retry"
        return None
