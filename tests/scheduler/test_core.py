"""Every scheduling rule, in virtual time: `now` is a float the test chooses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.scheduler.core import Admitted, Rejected, SchedulerCore
from server.scheduler.refusals import refusal_error

from .helpers import BULK, CHAT, admit, config, core, ids, ticket


# --- budgets -------------------------------------------------------------------------------
def test_dispatch_waits_for_the_token_budget_and_resumes_on_release() -> None:
    s = core(tokens=100)
    for rid in "abc":
        admit(s, ticket(rid, prompt=20, max_tokens=20))  # 40 tokens each
    assert ids(s.poll(0.0).started) == ["a", "b"]
    assert s.ledger.in_use()["tokens"] == 80
    assert s.release("a", 0.5, completed=True) == "running"
    assert ids(s.poll(0.5).started) == ["c"]


def test_dispatch_waits_for_kv_blocks() -> None:
    s = core(kv_blocks=5, block_size=16)  # 80 tokens of cache
    admit(s, ticket("a", prompt=30, max_tokens=10))  # 40 tokens -> 3 blocks
    admit(s, ticket("b", prompt=30, max_tokens=10))
    assert ids(s.poll(0.0).started) == ["a"]
    assert s.ledger.in_use()["kv_blocks"] == 3
    s.release("a", 1.0)
    assert ids(s.poll(1.0).started) == ["b"]


def test_dispatch_waits_for_a_free_sequence() -> None:
    s = core(sequences=2)
    for rid in "abc":
        admit(s, ticket(rid))
    assert ids(s.poll(0.0).started) == ["a", "b"]
    assert s.poll(0.1).started == []
    s.release("b", 0.2)
    assert ids(s.poll(0.2).started) == ["c"]


def test_n_choices_hold_n_sequences_and_n_times_max_tokens() -> None:
    s = core(sequences=4, tokens=1000)
    admit(s, replace(ticket("three", prompt=20, max_tokens=30), n=3))
    admit(s, replace(ticket("two"), n=2))
    assert ids(s.poll(0.0).started) == ["three"]  # 3 of 4 sequences: two more do not fit
    assert s.ledger.in_use()["sequences"] == 3 and s.running_count() == 3
    assert s.ledger.in_use()["tokens"] == 20 + 3 * 30  # one prompt, three answers
    s.release("three", 1.0, completed=True)
    assert ids(s.poll(1.0).started) == ["two"]
    refused = s.submit(replace(ticket("five"), n=5), 1.0)
    assert isinstance(refused, Rejected) and refused.reason == "request_too_large"
    assert "5 sequences" in refused.message


def test_every_ending_returns_the_budgets_to_zero() -> None:
    s = core(sequences=2)
    admit(s, ticket("done"))
    admit(s, ticket("aborted"))
    admit(s, ticket("cancelled-queued"))
    admit(s, ticket("expires", deadline=5.0))
    assert ids(s.poll(0.0).started) == ["done", "aborted"]
    s.release("done", 1.0, completed=True)
    s.release("aborted", 1.0)
    assert s.release("cancelled-queued", 1.0) == "queued"
    assert ids(s.poll(5.0).expired) == ["expires"]
    assert s.is_idle()
    assert s.ledger.in_use() == {"tokens": 0, "kv_blocks": 0, "sequences": 0}


def test_a_request_larger_than_its_class_budget_is_refused() -> None:
    s = core(tokens=100)
    decision = s.submit(ticket("huge", prompt=90, max_tokens=20), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "request_too_large"
    assert refusal_error(decision.reason, decision.message, decision.retry_after).status == 400


# --- traffic classes -----------------------------------------------------------------------
def test_interactive_is_dispatched_before_bulk_that_arrived_earlier() -> None:
    s = core(sequences=1)
    admit(s, ticket("running"))
    s.poll(0.0)
    admit(s, ticket("bulk", at=0.1, traffic_class=BULK))
    admit(s, ticket("chat", at=0.2))
    s.release("running", 0.3)
    assert ids(s.poll(0.3).started) == ["chat"]


def test_bulk_flood_leaves_the_interactive_reserve_free() -> None:
    cfg = config(budgets={"interactive_reserve_share": 0.25, "bulk_min_share": 0.1})
    s = core(cfg, sequences=8)
    for n in range(20):
        admit(s, ticket(f"bulk{n}", traffic_class=BULK))
    assert len(s.poll(0.0).started) == 6  # floor(8 * 0.75)
    admit(s, ticket("chat", at=0.004))
    # The chat starts at the next dispatch decision, with no bulk request finishing first.
    assert ids(s.poll(0.004).started) == ["chat"]


def test_interactive_flood_leaves_bulk_its_minimum_share() -> None:
    cfg = config(budgets={"interactive_reserve_share": 0.2, "bulk_min_share": 0.25})
    s = core(cfg, sequences=8)
    for n in range(20):
        admit(s, ticket(f"chat{n}"))
    admit(s, ticket("bulk0", traffic_class=BULK))
    admit(s, ticket("bulk1", traffic_class=BULK))
    started = ids(s.poll(0.0).started)
    assert started.count("bulk0") + started.count("bulk1") == 2  # floor(8 * 0.25)
    assert len(started) == 8


# --- tenants -------------------------------------------------------------------------------
TWO_TENANTS = {
    "tenants": {
        "flood": {"api_keys": ["k1"]},
        "steady": {"api_keys": ["k2"]},
    },
    "classes": {"interactive": {"max_queued": 1000, "tenant_queue_share": 0.9}},
    "budgets": {"fairness_quantum_tokens": 100},
}


def test_tenant_fair_share_holds_while_another_tenant_floods() -> None:
    """Equal-size requests: the steady tenant gets half the dispatches despite a 10x flood."""
    s = core(config(**TWO_TENANTS), sequences=4)
    for n in range(400):
        admit(s, ticket(f"f{n}", tenant="flood", at=n * 0.001))
    for n in range(40):
        admit(s, ticket(f"s{n}", tenant="steady", at=0.5 + n * 0.01))
    dispatched: list[str] = []
    now = 1.0
    while len(dispatched) < 80:
        started = s.poll(now).started
        dispatched.extend(ids(started))
        for t in started:
            s.release(t.request_id, now + 0.05)
        now += 0.05
    window = dispatched[:80]
    steady = sum(1 for rid in window if rid.startswith("s"))
    assert 35 <= steady <= 45  # half, to within one quantum per turn


def test_a_light_tenant_is_judged_by_its_fair_share_of_the_queue() -> None:
    # 10 ms steps, one seat: each 10-token request takes 0.1 s.
    cfg = config(
        **{
            **TWO_TENANTS,
            "estimates": {
                "prefill_tokens_per_s": 1e9,
                "decode_tokens_per_s": 100,
                "admission_margin": 0,
            },
        }
    )
    s = core(cfg, sequences=1)
    for n in range(50):
        admit(s, ticket(f"f{n}", tenant="flood", deadline=100.0))  # 5 s of work
    # Fair queueing serves the steady tenant's first request after about one flood request
    # (0.1 s), then its own 0.1 s: it meets a 0.5 s deadline the whole flood would not allow.
    admit(s, ticket("s0", tenant="steady", deadline=0.5))
    decision = s.submit(ticket("f50", tenant="flood", deadline=0.5), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"


def test_fairness_is_by_tokens_not_requests() -> None:
    s = core(config(**TWO_TENANTS), sequences=1)
    for n in range(50):
        admit(s, ticket(f"big{n}", tenant="flood", prompt=500, max_tokens=500))
        admit(s, ticket(f"small{n}", tenant="steady", prompt=50, max_tokens=50))
    tokens = {"flood": 0, "steady": 0}
    now = 0.0
    for _ in range(44):
        (started,) = s.poll(now).started
        tokens[started.tenant] += started.reserved_tokens
        s.release(started.request_id, now)
        now += 1.0
    assert abs(tokens["flood"] - tokens["steady"]) <= 1000 + 100


def test_tenant_concurrency_quota_answers_429_with_retry_after() -> None:
    s = core(config(tenants={"t": {"api_keys": ["k"], "max_concurrent": 2}}))
    admit(s, ticket("a", tenant="t"))
    admit(s, ticket("b", tenant="t"))
    decision = s.submit(ticket("c", tenant="t"), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "tenant_quota_exceeded"
    error = refusal_error(decision.reason, decision.message, decision.retry_after)
    assert (error.status, error.code) == (429, "tenant_quota_exceeded")
    assert error.headers()["Retry-After"] == "1"
    s.release("a", 0.1)
    admit(s, ticket("c", tenant="t"), now=0.1)


def test_tokens_per_minute_quota_reopens_when_the_window_slides() -> None:
    s = core(config(tenants={"t": {"api_keys": ["k"], "tokens_per_minute": 100}}))
    admit(s, ticket("a", tenant="t", at=0.0, prompt=30, max_tokens=30))  # 60 tokens
    admit(s, ticket("b", tenant="t", at=10.0, prompt=10, max_tokens=10))  # 80 tokens
    refused = s.submit(ticket("c", tenant="t", at=20.0, prompt=20, max_tokens=20), 20.0)
    assert isinstance(refused, Rejected) and refused.reason == "tenant_quota_exceeded"
    assert refused.retry_after == pytest.approx(40.0)  # when "a" leaves the window
    admit(s, ticket("c", tenant="t", at=60.0, prompt=20, max_tokens=20))


def test_one_tenant_cannot_fill_the_waiting_room() -> None:
    cfg = config(
        tenants={"flood": {"api_keys": ["k1"]}, "other": {"api_keys": ["k2"]}},
        classes={"interactive": {"max_queued": 10, "tenant_queue_share": 0.5}},
    )
    s = core(cfg, sequences=1)
    results = [s.submit(ticket(f"f{n}", tenant="flood"), 0.0) for n in range(8)]
    assert sum(isinstance(r, Admitted) for r in results) == 5
    assert {r.reason for r in results if isinstance(r, Rejected)} == {"tenant_quota_exceeded"}
    admit(s, ticket("o", tenant="other"))


# --- bounded queues ------------------------------------------------------------------------
def test_queue_bounded_by_count_answers_overloaded_at_once() -> None:
    s = core(config(classes={"bulk": {"max_queued": 3}}), sequences=1)
    for n in range(3):
        admit(s, ticket(f"b{n}", traffic_class=BULK))
    decision = s.submit(ticket("b3", traffic_class=BULK), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "overloaded"
    assert decision.retry_after is not None and decision.retry_after >= 1.0
    error = refusal_error(decision.reason, decision.message, decision.retry_after)
    assert (error.status, error.code) == (503, "overloaded")
    admit(s, ticket("chat"))  # the other class has its own bound


def test_queue_bounded_by_tokens() -> None:
    s = core(config(classes={"interactive": {"max_queued_tokens": 100}}), sequences=1)
    admit(s, ticket("a", prompt=30, max_tokens=30))
    decision = s.submit(ticket("b", prompt=30, max_tokens=30), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "overloaded"
    admit(s, ticket("c", prompt=20, max_tokens=20))


# --- deadlines -----------------------------------------------------------------------------
# The estimate's own rules, without admission's safety margin (tested on its own below).
def test_unmeetable_deadline_is_rejected_at_admission() -> None:
    cfg = config(
        estimates={"prefill_tokens_per_s": 1000, "decode_tokens_per_s": 10, "admission_margin": 0}
    )
    s = core(cfg)
    # 100 prompt tokens at 1000/s + 20 output tokens at 10/s = 2.1 s of service.
    decision = s.submit(ticket("late", deadline=2.0, prompt=100, max_tokens=20), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    assert (
        refusal_error(decision.reason, decision.message, decision.retry_after).code
        == "deadline_unmeetable"
    )
    admit(s, ticket("fits", deadline=2.2, prompt=100, max_tokens=20))


def test_queue_ahead_counts_toward_the_deadline_estimate() -> None:
    cfg = config(
        estimates={"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 10, "admission_margin": 0}
    )
    s = core(cfg, sequences=1)
    admit(s, ticket("running", max_tokens=10, deadline=100.0))  # 1 s of service
    s.poll(0.0)
    admit(s, ticket("queued", max_tokens=10, deadline=100.0))
    # Ahead of a newcomer: ~1 s running + 1 s queued, then its own 1 s.
    decision = s.submit(ticket("new", max_tokens=10, deadline=2.5), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    admit(s, ticket("new", max_tokens=10, deadline=3.1))


def test_an_answer_without_max_tokens_is_judged_by_its_typical_length() -> None:
    cfg = config(
        estimates={
            "prefill_tokens_per_s": 1e9,
            "decode_tokens_per_s": 10,
            "open_ended_output_tokens": 50,
            "smoothing": 0.5,
            "admission_margin": 0,
        }
    )
    s = core(cfg)
    # It reserves the rest of a 2,000-token context, but such answers run ~50 tokens: 5 s.
    rest = 2000 - 10
    assert s.ledger.ever_fits(ticket("x", max_tokens=rest, open_ended=True))
    decision = s.submit(ticket("bounded", max_tokens=rest, deadline=30.0), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    admit(s, ticket("open", max_tokens=rest, open_ended=True, deadline=5.1))
    decision = s.submit(ticket("tight", max_tokens=rest, open_ended=True, deadline=4.9), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    # The typical length is learned from open-ended answers that finished.
    s.poll(0.0)
    s.generated("open", 150, 3.0)
    s.release("open", 3.0, completed=True)
    assert s.estimates.open_ended_output_tokens == pytest.approx(100)


def test_admission_keeps_a_margin_for_the_estimates_error() -> None:
    cfg = config(
        estimates={"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 10, "admission_margin": 0.1}
    )
    s = core(cfg)
    # 20 tokens at 10/s: 2 s predicted, so with a 10% margin it needs 2.2 s.
    decision = s.submit(ticket("edge", deadline=2.1, max_tokens=20), 0.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    assert "10% margin" in decision.message
    admit(s, ticket("fits", deadline=2.21, max_tokens=20))


def test_queued_request_expires_exactly_at_its_deadline() -> None:
    s = core(sequences=1)
    admit(s, ticket("running"))
    s.poll(0.0)
    admit(s, ticket("e", at=0.001, deadline=0.150))
    assert s.poll(0.001).wake_at == 0.150
    assert s.poll(0.149).expired == []
    step = s.poll(0.150)
    assert ids(step.expired) == ["e"]
    assert s.stage("e") is None
    assert step.wake_at is None


def test_expired_request_is_never_dispatched_and_late_release_is_a_no_op() -> None:
    s = core(sequences=1)
    admit(s, ticket("running"))
    s.poll(0.0)
    admit(s, ticket("e", deadline=0.15))
    s.release("running", 0.2)  # budget frees after e's deadline
    step = s.poll(0.2)
    assert step.started == []
    assert ids(step.expired) == ["e"]
    assert s.release("e", 0.3, completed=True) is None
    assert s.release("running", 0.3) is None
    assert s.is_idle()


def test_already_passed_deadline_is_unmeetable() -> None:
    s = core()
    decision = s.submit(ticket("old", at=0.0, deadline=0.5), 1.0)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"


# --- cancellation --------------------------------------------------------------------------
def test_cancelled_queued_request_is_removed_without_dispatch() -> None:
    s = core(sequences=1)
    admit(s, ticket("running"))
    s.poll(0.0)
    admit(s, ticket("gone"))
    admit(s, ticket("next"))
    assert s.release("gone", 0.1) == "queued"
    s.release("running", 0.2)
    assert ids(s.poll(0.2).started) == ["next"]


# --- estimates -----------------------------------------------------------------------------
def test_prefill_rate_is_learned_from_the_first_token_of_a_long_prompt() -> None:
    cfg = config(
        estimates={"prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100, "smoothing": 0.5}
    )
    s = core(cfg)
    admit(s, ticket("a", prompt=1000, max_tokens=11))
    admit(s, ticket("b", prompt=1000, max_tokens=11))
    s.poll(0.0)
    # 1000 tokens in 0.26 s, less the 10 ms step their prefill shared with "a": 4000/s.
    s.generated("b", 1, 0.26)
    assert s.estimates.prefill_tokens_per_s == pytest.approx(2500)
    # A short prompt's first token says more about the steps around it than about prefill.
    admit(s, ticket("c", prompt=10, max_tokens=11), 1.0)
    s.poll(1.0)
    s.generated("c", 1, 1.5)
    assert s.estimates.prefill_tokens_per_s == pytest.approx(2500)


def run_steps(
    s: SchedulerCore, request_ids: list[str], start: float, step_s: float, steps: int
) -> float:
    """Each running request gets one token per engine step; returns the time after the last."""
    now = start
    for _ in range(steps):
        now += step_s
        for request_id in request_ids:
            s.generated(request_id, 1, now)
    return now


def test_decode_step_time_is_learned_at_the_concurrency_it_ran_at() -> None:
    cfg = config(
        estimates={"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 10, "smoothing": 0.5}
    )
    s = core(cfg)
    admit(s, ticket("solo", max_tokens=1000))
    s.poll(0.0)
    now = run_steps(s, ["solo"], 0.0, 0.01, 60)  # one sequence: 10 ms steps
    four = ["solo", "b", "c", "d"]
    for request_id in four[1:]:
        admit(s, ticket(request_id, max_tokens=1000), now)
    s.poll(now)
    run_steps(s, four, now, 0.025, 200)  # four sequences: 25 ms steps
    # (The window that spans the change blends into the 4-sequence estimate, then fades.)
    assert s.estimates.decode_tokens_per_s(1) == pytest.approx(100)
    assert s.estimates.decode_tokens_per_s(4) == pytest.approx(40, rel=1e-3)
    assert s.estimates.decode_tokens_per_s(2) == pytest.approx(1 / 0.015, rel=1e-3)


def test_a_steps_outputs_reported_at_once_count_as_each_reported_alone() -> None:
    # The simulator reports an engine step's outputs in one call (generated_many); the server
    # reports each delta (generated, then release when it completes). Both must leave the core
    # in the same state, to the last bit: the simulator's reports must not change with it.
    cfg = config(
        estimates={"prefill_tokens_per_s": 1e5, "decode_tokens_per_s": 100, "smoothing": 0.5}
    )
    one_call, each_alone = core(cfg, sequences=40), core(cfg, sequences=40)
    # 30 end together (the running count falls past a window jump mid-step), the rest spread
    # out; some stop short of max_tokens (the output estimate turns fractional), and those
    # queued behind start as the others end.
    lengths = {f"r{n}": (45 if n < 30 else 46 + 7 * n % 50) for n in range(60)}
    for s in (one_call, each_alone):
        for n, (rid, length) in enumerate(lengths.items()):
            admit(s, ticket(rid, prompt=300, max_tokens=length + n % 3))
        s.poll(0.0)
    left = {t.request_id: lengths[t.request_id] for t in one_call.running_tickets()}
    assert [t.request_id for t in each_alone.running_tickets()] == list(left)
    now = 0.0
    probe = ticket("probe", prompt=50, max_tokens=50)
    while left:
        now += 0.012
        outputs = []
        for rid in list(left):
            left[rid] -= 1
            outputs.append((rid, 1, left[rid] == 0))
            if left[rid] == 0:
                del left[rid]
        one_call.generated_many(outputs, now)
        for rid, tokens, completed in outputs:
            each_alone.generated(rid, tokens, now)
            if completed:
                each_alone.release(rid, now, completed=True)
        started = [ids(s.poll(now).started) for s in (one_call, each_alone)]
        assert started[0] == started[1]
        left.update({rid: lengths[rid] for rid in started[0]})
        for s in (one_call, each_alone):
            assert s.ledger.in_use() == one_call.ledger.in_use()
            assert s.estimates.output_fraction == one_call.estimates.output_fraction
            assert s.predicted_wait(probe, now) == one_call.predicted_wait(probe, now)
            for concurrency in (1, 8, 24, 40):
                assert s.estimates.steps.at(concurrency) == one_call.estimates.steps.at(concurrency)
    assert one_call.estimates.steps.revision == each_alone.estimates.steps.revision >= 3
    assert 0 < one_call.estimates.output_fraction < 1
    assert one_call.is_idle() and each_alone.is_idle()


def test_admission_judges_queued_work_at_the_step_time_it_sees_now() -> None:
    # The prior says 10 ms steps; the engine, once four sequences run, takes 40 ms.
    cfg = config(
        estimates={
            "prefill_tokens_per_s": 1e9,
            "decode_tokens_per_s": 100,
            "smoothing": 0.5,
            "admission_margin": 0,
        }
    )
    s = core(cfg, sequences=4)
    running = [f"r{n}" for n in range(4)]
    for request_id in running:
        admit(s, ticket(request_id, max_tokens=100))
    s.poll(0.0)
    for n in range(4):
        admit(s, ticket(f"q{n}", max_tokens=100))  # queued while the estimate said 10 ms
    now = run_steps(s, running, 0.0, 0.04, 14)
    # Ahead of a newcomer: 4 x 86 tokens running and 4 x 100 queued, at 40 ms a step over
    # four sequences: 7.44 s; then its own 100 tokens at 40 ms: 4 s. Done at 0.56 + 11.44.
    decision = s.submit(ticket("late", at=now, deadline=11.9, max_tokens=100), now)
    assert isinstance(decision, Rejected) and decision.reason == "deadline_unmeetable"
    admit(s, ticket("fits", at=now, deadline=12.1, max_tokens=100))


def test_pressure_rises_with_the_queue() -> None:
    cfg = config(estimates={"prefill_tokens_per_s": 1e9, "decode_tokens_per_s": 10})
    s = core(cfg, sequences=1)
    assert s.pressure(CHAT, 0.0) == 0.0
    for n in range(5):
        admit(s, ticket(f"q{n}", max_tokens=10))
    assert s.pressure(CHAT, 0.0) > 0.0
