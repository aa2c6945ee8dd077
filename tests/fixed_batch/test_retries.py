"""What a failed batch retries: whole once, then halves, until the culprit fails alone."""

from __future__ import annotations

import math

from server.fixed_batch.decisions import BatchOutcome
from server.fixed_batch.queues import LiveRequest
from server.fixed_batch.retries import Retries

from .helpers import ticket


def members(names: str) -> list[LiveRequest]:
    return [LiveRequest(ticket(n, 0.0), math.inf) for n in names]


def ids(groups: list[list[LiveRequest]] | None) -> list[str] | None:
    return None if groups is None else ["".join(m.ticket.request_id for m in g) for g in groups]


def test_a_batch_is_retried_whole_then_bisected_down_to_its_culprit() -> None:
    retries = Retries(attempt_budget=5)
    batch = members("ABCD")
    assert ids(retries.regroup(batch)) == ["ABCD"]
    assert ids(retries.regroup(batch)) == ["AB", "CD"]
    assert ids(retries.regroup(batch[2:])) == ["C", "D"]
    assert ids(retries.regroup(batch[3:])) is None  # D crashed its batch again, alone
    assert retries.culprit_reason(batch[3]).startswith("request crashed its batch 4 times")


def test_a_retry_is_refused_past_the_attempt_budget_or_the_deadline() -> None:
    retries = Retries(attempt_budget=2)
    spent, late, kept = members("ABC")
    spent.attempts = 2
    late.latest_start = 0.05
    assert retries.refusal(spent, 0.0) == (BatchOutcome.FAILED, "attempt budget of 2 exhausted")
    assert retries.refusal(late, 0.1) == (BatchOutcome.EXPIRED, "deadline cannot be met by a retry")
    assert retries.refusal(kept, 0.1) is None
