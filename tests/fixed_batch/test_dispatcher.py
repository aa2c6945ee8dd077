"""The batch dispatcher core on its own: admission, deadlines, fencing, cancellation."""

from __future__ import annotations

from server.fixed_batch.decisions import BatchOutcome, CancelStage
from server.fixed_batch.dispatcher import BatchDispatcher
from server.scheduler.types import RejectReason

from .helpers import exercise_config, ticket


def test_deadline_pressure_dispatches_before_the_batching_delay_runs_out() -> None:
    core = BatchDispatcher(exercise_config(max_delay_s=0.050))
    assert core.submit(ticket("A", 0.0, deadline=0.120), 0.0) is None
    assert core.poll(0.0).dispatches == []
    assert core.next_timer() == 0.120 - 0.1
    (dispatch,) = core.poll(core.next_timer() or 0).dispatches
    assert [t.request_id for t in dispatch.tickets] == ["A"]


def test_the_queue_is_bounded() -> None:
    core = BatchDispatcher(exercise_config(max_queue=2))
    assert core.submit(ticket("A", 0.0), 0.0) is None
    assert core.submit(ticket("B", 0.0), 0.0) is None
    assert core.submit(ticket("C", 0.0), 0.0) is RejectReason.OVERLOADED


def test_a_queued_request_expires_as_soon_as_its_deadline_is_out_of_reach() -> None:
    core = BatchDispatcher(exercise_config())
    for i, name in enumerate("ABCDEFGH"):
        assert core.submit(ticket(name, 0.0), 0.0) is None, i
    assert core.submit(ticket("I", 0.002, deadline=0.299), 0.002) is None  # optimistic
    assert len(core.poll(0.002).dispatches) == 1
    core.complete_batch(0, [(n, 0) for n in "ABCD"], 0.1)
    step = core.poll(0.1)
    assert [t.request_id for t in step.dispatches[0].tickets] == list("EFGH")
    assert [(e.ticket.request_id, e.outcome) for e in step.ended] == [("I", BatchOutcome.EXPIRED)]


def test_results_of_a_failed_attempt_are_fenced_and_each_request_resolves_once() -> None:
    core = BatchDispatcher(exercise_config())
    core.submit(ticket("A", 0.0), 0.0)
    core.submit(ticket("B", 0.0), 0.0)
    (first,) = core.poll(0.010).dispatches
    failure = core.on_worker_failure(first.worker_id, 0.050)
    assert [t.request_id for t in failure.retried] == ["A", "B"]
    core.worker_up(first.worker_id)
    (second,) = core.poll(0.050).dispatches
    assert second.retry and second.attempt_id != first.attempt_id

    late = core.complete_batch(
        first.lease_id, [("A", first.attempt_id), ("B", first.attempt_id)], 0.08
    )
    assert late.delivered == [] and len(late.discarded) == 2 and not late.worker_freed

    done = core.complete_batch(
        second.lease_id, [("A", second.attempt_id), ("B", second.attempt_id)], 0.15
    )
    assert [t.request_id for t in done.delivered] == ["A", "B"]
    again = core.complete_batch(second.lease_id, [("A", second.attempt_id)], 0.16)
    assert again.delivered == [] and core.live_requests == 0


def test_an_expired_lease_loses_the_worker_and_its_late_answer_is_discarded() -> None:
    core = BatchDispatcher(exercise_config(lease_s=0.3))
    core.submit(ticket("A", 0.0), 0.0)
    (first,) = core.poll(0.010).dispatches
    assert core.next_timer() == 0.010 + 0.3
    step = core.poll(0.310)
    assert step.lost_workers == [0] and [t.request_id for t in step.retried] == ["A"]
    core.worker_up(0)
    (second,) = core.poll(0.310).dispatches
    assert core.on_result("A", first.attempt_id) is None
    assert core.on_result("A", second.attempt_id) is not None


def test_cancelling_a_queued_request_removes_it() -> None:
    core = BatchDispatcher(exercise_config())
    core.submit(ticket("A", 0.0), 0.0)
    core.submit(ticket("B", 0.0), 0.0)
    assert core.cancel("A") is CancelStage.QUEUED
    assert core.queue_depth("sluice-demo") == 1
    (dispatch,) = core.poll(0.010).dispatches
    assert [t.request_id for t in dispatch.tickets] == ["B"]
    assert core.cancel("A") is None


def test_cancelling_a_running_request_fences_its_result() -> None:
    core = BatchDispatcher(exercise_config())
    core.submit(ticket("A", 0.0), 0.0)
    core.submit(ticket("B", 0.0), 0.0)
    (dispatch,) = core.poll(0.010).dispatches
    assert core.cancel("A") is CancelStage.RUNNING
    done = core.complete_batch(
        dispatch.lease_id, [("A", dispatch.attempt_id), ("B", dispatch.attempt_id)], 0.11
    )
    assert [t.request_id for t in done.delivered] == ["B"]
    assert done.discarded == [("A", dispatch.attempt_id)] and done.worker_freed


def test_a_cancelled_member_is_not_retried_when_its_batch_fails() -> None:
    core = BatchDispatcher(exercise_config())
    core.submit(ticket("A", 0.0), 0.0)
    core.submit(ticket("B", 0.0), 0.0)
    core.poll(0.010)
    core.cancel("A")
    failure = core.on_worker_failure(0, 0.05)
    assert [t.request_id for t in failure.retried] == ["B"]


def test_the_batch_timer_does_not_invent_a_free_worker() -> None:
    core = BatchDispatcher(exercise_config())
    for name in "ABCD":
        core.submit(ticket(name, 0.0), 0.0)
    core.poll(0.0)
    core.submit(ticket("E", 0.001), 0.001)
    assert core.poll(0.011).dispatches == []
    assert core.next_timer() == 0.0 + 3 * 0.1  # only the lease; no batching timer
