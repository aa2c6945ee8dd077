"""Worker death, hung workers, poison requests and cancellation, in virtual time."""

from __future__ import annotations

from collections import Counter

from server.fixed_batch.simulate import Faults, RequestRecord, SimResult, simulate
from server.simulation.workload import Arrival, parse_trace

from .helpers import exercise_config, ms


def by_id(result: SimResult) -> dict[str, RequestRecord]:
    return {r.id: r for r in result.requests}


def assert_exactly_once(result: SimResult) -> None:
    assert result.duplicate_deliveries == 0
    assert all(r.outcome is not None for r in result.requests)
    assert all((r.finish is not None) == (r.outcome == "completed") for r in result.requests)


def test_worker_death_mid_batch_retries_the_unfinished_requests() -> None:
    config = exercise_config(workers=("sluice-demo",) * 2)
    trace = parse_trace(",".join(f"R{i}@0" for i in range(8)))
    result = simulate(config, trace, faults=Faults(kills=((0, 0.050),)))
    assert_exactly_once(result)
    finishes = Counter(ms(r.finish) for r in result.requests)
    assert finishes == {100.0: 4, 150.0: 4}  # worker 0's batch reran from 50 ms
    assert sorted(r.attempts for r in result.requests) == [1] * 4 + [2] * 4
    assert [(b.size, b.status, b.retry) for b in result.batches] == [
        (4, "crashed", False),
        (4, "completed", False),
        (4, "completed", True),
    ]


def test_no_retry_past_the_deadline() -> None:
    trace = parse_trace("A@0:deadline=140,B@0:deadline=500")
    result = simulate(exercise_config(), trace, faults=Faults(kills=((0, 0.050),)))
    a, b = by_id(result)["A"], by_id(result)["B"]
    assert (a.outcome, a.attempts, ms(a.ended)) == ("expired", 1, 50.0)
    assert (b.outcome, ms(b.finish)) == ("completed", 150.0)


def test_no_retry_past_the_attempt_budget() -> None:
    config = exercise_config(max_attempts=2)
    trace = parse_trace(",".join(f"R{i}@{i}" for i in range(6)))
    result = simulate(config, trace, faults=Faults(fail_rate=1.0))
    assert_exactly_once(result)
    assert {r.outcome for r in result.requests} == {"failed"}
    assert max(r.attempts for r in result.requests) <= 2


def test_a_poison_request_is_isolated_and_the_rest_of_its_batch_completes() -> None:
    config = exercise_config(max_batch=32)
    arrivals = [Arrival(f"R{i}", 0.0, prompt="POISON" if i == 5 else "") for i in range(32)]
    result = simulate(config, arrivals)
    assert_exactly_once(result)
    outcomes = {r.id: r.outcome for r in result.requests}
    assert outcomes.pop("R5") == "failed"
    assert set(outcomes.values()) == {"completed"}
    poison = by_id(result)["R5"]
    assert "alone" in (poison.reason or "")
    budget = config.attempt_budget
    assert max(r.attempts for r in result.requests) <= budget
    # whole-group retry, then halves 16, 8, 4, 2, 1: every crashed batch holds the poison
    crashed = [b.size for b in result.batches if b.status == "crashed"]
    assert crashed == [32, 32, 16, 8, 4, 2, 1]


def test_a_hung_worker_loses_its_lease_and_its_late_answer_is_discarded() -> None:
    trace = parse_trace("A@0,B@0")
    faults = Faults(hangs=((0, 0.0),), hang_s=1.0)
    result = simulate(exercise_config(lease_s=0.3), trace, faults=faults)
    assert_exactly_once(result)
    assert [ms(r.finish) for r in result.requests] == [410.0, 410.0]
    assert result.discarded_results == 2  # the answers that came at 1010 ms


def test_a_cancelled_running_request_is_fenced() -> None:
    result = simulate(
        exercise_config(), parse_trace("A@0,B@0"), faults=Faults(cancels=(("A", 0.05),))
    )
    a, b = by_id(result)["A"], by_id(result)["B"]
    assert (a.outcome, a.finish, ms(a.ended)) == ("cancelled", None, 50.0)
    assert (b.outcome, ms(b.finish)) == ("completed", 110.0)
    assert result.discarded_results == 1


def test_a_cancelled_queued_request_leaves_the_queue() -> None:
    result = simulate(
        exercise_config(), parse_trace("A@0,B@0"), faults=Faults(cancels=(("A", 0.005),))
    )
    assert [(b.size, ms(b.start)) for b in result.batches] == [(1, 10.0)]
    assert by_id(result)["A"].dispatch is None


def test_random_failures_under_load_never_deliver_twice() -> None:
    from server.simulation.workload import poisson_arrivals

    config = exercise_config(workers=("sluice-demo",) * 3, max_batch=8)
    arrivals = poisson_arrivals(60, 5.0, seed=3, relative_deadline_s=0.6)
    result = simulate(config, arrivals, faults=Faults(fail_rate=0.2, seed=3))
    assert_exactly_once(result)
    for r in result.requests:
        assert r.attempts <= config.attempt_budget
        if r.outcome == "completed":
            assert r.finish is not None and r.deadline is not None and r.finish <= r.deadline
