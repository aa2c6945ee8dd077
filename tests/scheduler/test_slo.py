"""Each request's SLO verdict: one function for the server and the simulator."""

from __future__ import annotations

import pytest

from server.scheduler.slo import slo_result
from server.scheduler.types import SloTargets

TARGETS = SloTargets(ttft_s=0.1, itl_s=0.01)


@pytest.mark.parametrize(
    ("outcome", "refusal", "ttft", "itl", "targets", "expected"),
    [
        ("completed", None, 0.05, 0.005, TARGETS, ("met", "none")),
        ("completed", None, 0.15, 0.020, TARGETS, ("missed", "ttft")),  # the first promise broken
        ("completed", None, 0.05, 0.020, TARGETS, ("missed", "itl")),
        ("completed", None, 0.05, None, TARGETS, ("met", "none")),  # one token: no gap to judge
        ("completed", None, 9.0, 9.0, None, ("met", "none")),  # bulk: no latency targets
        ("expired", None, None, None, TARGETS, ("missed", "expired")),
        ("failed", None, 0.05, None, None, ("missed", "failed")),
        ("rejected", "overloaded", None, None, TARGETS, ("missed", "refused")),
        ("rejected", "deadline_unmeetable", None, None, None, ("missed", "refused")),
        ("rejected", "tenant_quota_exceeded", None, None, TARGETS, None),  # the tenant's own
        ("invalid", None, None, None, TARGETS, None),
        ("cancelled", None, 0.05, None, TARGETS, None),  # left after a timely first token
    ],
)
def test_each_ending_gets_one_verdict(outcome, refusal, ttft, itl, targets, expected) -> None:  # type: ignore[no-untyped-def]
    assert slo_result(outcome, refusal, 1.0, ttft, itl, targets) == expected


def test_a_client_that_gave_up_waiting_past_the_ttft_target_counts_as_missed() -> None:
    assert slo_result("cancelled", None, 0.5, None, None, TARGETS) == ("missed", "ttft")
    assert slo_result("cancelled", None, 0.05, None, None, TARGETS) is None
