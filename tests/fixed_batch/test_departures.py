"""When a batch leaves, on one queue: full, its oldest waited the delay, or a deadline."""

from __future__ import annotations

import math

from server.fixed_batch.departures import Departures
from server.fixed_batch.queues import LiveRequest, ModelQueue

from .helpers import MODEL, ticket


def queued(*arrivals: tuple[str, float, float]) -> ModelQueue:
    """A queue of fresh requests: (id, arrival, latest start)."""
    queue = ModelQueue(MODEL)
    for request_id, arrival, latest in arrivals:
        queue.push(LiveRequest(ticket(request_id, arrival), latest))
    return queue


def test_a_partial_batch_leaves_when_its_oldest_has_waited_the_delay() -> None:
    rule = Departures(max_batch=4, max_delay_s=0.010)
    queue = queued(("A", 0.0, math.inf), ("B", 0.007, math.inf))
    assert rule.ready_at(queue) == 0.010
    assert rule.next_batch(queue, 0.009) is None
    members, retry = rule.next_batch(queue, 0.010) or ([], True)
    assert [m.ticket.request_id for m in members] == ["A", "B"] and not retry


def test_a_full_batch_leaves_at_once_and_the_rest_waits() -> None:
    rule = Departures(max_batch=2, max_delay_s=0.010)
    queue = queued(("A", 0.0, math.inf), ("B", 0.0, math.inf), ("C", 0.0, math.inf))
    assert rule.ready_at(queue) == -math.inf
    members, _ = rule.next_batch(queue, 0.0) or ([], True)
    assert [m.ticket.request_id for m in members] == ["A", "B"]
    assert rule.ready_at(queue) == 0.010 and queue.depth == 1


def test_a_deadline_brings_the_departure_forward() -> None:
    rule = Departures(max_batch=4, max_delay_s=0.050)
    assert rule.ready_at(queued(("A", 0.0, 0.020))) == 0.020


def test_a_retry_group_leaves_whole_before_fresh_requests() -> None:
    rule = Departures(max_batch=4, max_delay_s=0.010)
    queue = queued(("C", 0.0, math.inf))
    queue.push_group([LiveRequest(ticket(n, 0.0), math.inf) for n in "AB"])
    members, retry = rule.next_batch(queue, 0.0) or ([], False)
    assert [m.ticket.request_id for m in members] == ["A", "B"] and retry
