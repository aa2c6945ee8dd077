"""Fencing: a lease's id is its members' attempt id, and only the current one counts."""

from __future__ import annotations

import math

from server.fixed_batch.leases import Leases, is_current
from server.fixed_batch.queues import LiveRequest

from .helpers import ticket


def test_only_the_current_attempt_of_a_running_request_may_complete_it() -> None:
    leases = Leases(batch_time_s=0.1, timeout_s=0.3)
    a, b = LiveRequest(ticket("A", 0.0), math.inf), LiveRequest(ticket("B", 0.0), math.inf)
    first = leases.grant(0, [a, b], 0.0)
    assert (first.expected_finish, first.expires) == (0.1, 0.3)
    second = leases.grant(1, [a], 0.05)  # A retried elsewhere
    assert not is_current(a, first.lease_id) and is_current(a, second.lease_id)
    assert leases.unanswered(first) == [b] and a.attempts == 2


def test_a_lease_runs_out_once_and_an_ended_one_never() -> None:
    leases = Leases(batch_time_s=0.1, timeout_s=0.3)
    a = LiveRequest(ticket("A", 0.0), math.inf)
    answered, lost = leases.grant(0, [a], 0.0), leases.grant(1, [a], 0.1)
    assert leases.end(answered.lease_id) is answered and leases.end(answered.lease_id) is None
    assert leases.next_expiry() == 0.1 + 0.3
    assert not leases.due(0.39) and leases.due(0.4)
    assert list(leases.expired(0.4)) == [lost]
    assert list(leases.expired(0.4)) == []
