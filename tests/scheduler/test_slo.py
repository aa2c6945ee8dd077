"""Each request's SLO verdict: one function for the server and the simulator."""

from __future__ import annotations

import pytest

from server.core.errors import DeadlineUnmeetable, Overloaded, TenantQuotaExceeded
from server.scheduler.slo import SloTargets, slo_result

TARGETS = SloTargets(ttft_s=0.1, itl_s=0.01)


@pytest.mark.parametrize(
    ("outcome", "capacity_refusal", "ttft", "itl", "targets", "expected"),
    [
        ("completed", False, 0.05, 0.005, TARGETS, ("met", "none")),
        ("completed", False, 0.15, 0.020, TARGETS, ("missed", "ttft")),  # the first promise broken
        ("completed", False, 0.05, 0.020, TARGETS, ("missed", "itl")),
        ("completed", False, 0.05, None, TARGETS, ("met", "none")),  # one token: no gap to judge
        ("completed", False, 9.0, 9.0, None, ("met", "none")),  # bulk: no latency targets
        ("expired", False, None, None, TARGETS, ("missed", "expired")),
        ("failed", False, 0.05, None, None, ("missed", "failed")),
        ("rejected", Overloaded.capacity, None, None, TARGETS, ("missed", "refused")),
        ("rejected", DeadlineUnmeetable.capacity, None, None, None, ("missed", "refused")),
        ("rejected", TenantQuotaExceeded.capacity, None, None, TARGETS, None),  # the tenant's own
        ("invalid", False, None, None, TARGETS, None),
        ("cancelled", False, 0.05, None, TARGETS, None),  # left after a timely first token
    ],
)
def test_each_ending_gets_one_verdict(
    outcome, capacity_refusal, ttft, itl, targets, expected
) -> None:  # type: ignore[no-untyped-def]
    assert slo_result(outcome, capacity_refusal, 1.0, ttft, itl, targets) == expected


def test_a_client_that_gave_up_waiting_past_the_ttft_target_counts_as_missed() -> None:
    assert slo_result("cancelled", False, 0.5, None, None, TARGETS) == ("missed", "ttft")
    assert slo_result("cancelled", False, 0.05, None, None, TARGETS) is None
