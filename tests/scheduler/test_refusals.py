"""Each scheduler refusal reason is answered by one error class, named in one map."""

from __future__ import annotations

from server.core.errors import ERRORS
from server.scheduler.refusals import REFUSALS, refusal_error
from server.scheduler.types import RejectReason


def test_every_reason_has_an_error_class() -> None:
    assert set(REFUSALS) == set(RejectReason)
    assert set(REFUSALS.values()) <= set(ERRORS.values())


def test_a_refusal_keeps_its_message_and_retry_after() -> None:
    error = refusal_error(RejectReason.OVERLOADED, "the queue is full", retry_after=2.4)
    assert (error.status, error.code, error.message) == (503, "overloaded", "the queue is full")
    assert error.headers() == {"Retry-After": "2"}


def test_only_the_services_own_refusals_count_as_capacity() -> None:
    capacity = {reason for reason, cls in REFUSALS.items() if cls.capacity}
    assert capacity == {RejectReason.OVERLOADED, RejectReason.DEADLINE_UNMEETABLE}
    # The scheduler's refusal codes are the metric's rejection reasons (one label vocabulary).
    for reason in capacity | {RejectReason.TENANT_QUOTA_EXCEEDED}:
        assert REFUSALS[reason].code == reason.value
