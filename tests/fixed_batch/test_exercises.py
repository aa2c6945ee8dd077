"""The design problem's three exercises, to the millisecond, in virtual time."""

from __future__ import annotations

from server.fixed_batch.simulate import simulate
from server.simulation.workload import parse_trace

from .helpers import exercise_config, ms


def timeline(trace: str) -> dict[str, tuple[float | None, float | None, str | None]]:
    result = simulate(exercise_config(), parse_trace(trace))
    return {r.id: (ms(r.dispatch), ms(r.finish), r.outcome) for r in result.requests}


def test_sparse_arrivals_leave_together_when_the_oldest_reaches_the_delay_limit() -> None:
    assert timeline("A@0,B@7") == {
        "A": (10.0, 110.0, "completed"),
        "B": (10.0, 110.0, "completed"),
    }


def test_a_full_batch_leaves_at_once() -> None:
    assert timeline("A@0,B@0,C@0,D@0") == {k: (0.0, 100.0, "completed") for k in "ABCD"}


def test_a_busy_worker_delays_e_past_its_batching_timer() -> None:
    result = timeline("A@0,B@0,C@0,D@0,E@1")
    assert result["E"] == (100.0, 200.0, "completed")
    assert all(result[k] == (0.0, 100.0, "completed") for k in "ABCD")


def test_e_with_deadline_150_is_rejected_at_admission_and_never_dispatched() -> None:
    result = simulate(exercise_config(), parse_trace("A@0,B@0,C@0,D@0,E@1:deadline=150"))
    e = next(r for r in result.requests if r.id == "E")
    assert (e.outcome, ms(e.ended), e.dispatch, e.finish) == ("rejected", 1.0, None, None)
    assert e.reason == "deadline_unmeetable"
    assert [b.size for b in result.batches] == [4]


def test_e_with_deadline_200_is_admitted_and_just_makes_it() -> None:
    result = timeline("A@0,B@0,C@0,D@0,E@1:deadline=200")
    assert result["E"] == (100.0, 200.0, "completed")


def test_an_overdue_partial_batch_leaves_the_moment_the_worker_frees_up() -> None:
    # E and F wait behind the full batch; at 100 ms they leave without a fresh 10 ms timer.
    result = timeline("A@0,B@0,C@0,D@0,E@1,F@50")
    assert result["E"] == result["F"] == (100.0, 200.0, "completed")


def test_requests_are_batched_only_with_their_model_version() -> None:
    config = exercise_config(workers=("a", "b"))
    result = simulate(config, parse_trace("A1@0:model=a,B1@2:model=b,A2@3:model=a"))
    by_id = {r.id: (ms(r.dispatch), r.worker) for r in result.requests}
    assert by_id == {"A1": (10.0, 0), "A2": (10.0, 0), "B1": (12.0, 1)}


def test_a_model_no_worker_holds_is_rejected() -> None:
    result = simulate(exercise_config(), parse_trace("A@0:model=other"))
    assert result.requests[0].reason == "no_compatible_worker"
