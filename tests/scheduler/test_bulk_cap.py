"""The bulk cap, in virtual time: bulk fills the engine to its knee while no chat runs, shrinks
to the interactive gap target when one arrives (preempting the excess, cheapest to resume
first), holds there for `bulk_hold_ms` after the last chat and while chats keep arriving
more often than that, then grows back."""

from __future__ import annotations

import itertools

import pytest

from server.scheduler.attainment import MIN_GAPS
from server.scheduler.core import SchedulerCore
from server.scheduler.estimates import AdapterCost
from server.scheduler.types import PreemptCause

from .helpers import BULK, admit, config, core, ids, ticket

# A CPU-shaped engine: step milliseconds by concurrency. Tokens/s: 500, 2000, 2000, 2667, 2560.
# The knee (95% of the best, 2667) is 32 sequences. The gap target, 3 x the idle 2 ms step, is
# 6 ms; the cap aims at 90% of it, 5.4 ms: 10 sequences (between 8 at 4 ms and 16 at 8 ms).
CPU_STEPS_MS = {1: 2.0, 8: 4.0, 16: 8.0, 32: 12.0, 64: 25.0}
IDLE_TTFT_S = 0.010  # TTFT target 30 ms: one step may take 20 ms, 51 sequences: not binding
BLOCK = 16


def calibrated(steps_ms: dict[int, float] = CPU_STEPS_MS, **slo: object) -> SchedulerCore:
    """The model's cap, open loop (`slo.feedback: false`) unless `slo` says otherwise: what the
    bulk controller corrects is tested in test_controller.py and in the simulator."""
    # Bulk may use 80 of the 100 sequences (20% is the interactive reserve).
    slo = {"feedback": False, **slo}
    s = core(config(slo=slo), tokens=10**6, kv_blocks=10**6, sequences=100, block_size=BLOCK)
    for n, step_ms in steps_ms.items():
        s.estimates.steps.observe(n, step_ms / 1000)
    s.estimates.observe_engine_ttft(IDLE_TTFT_S)
    return s


def flood(s: SchedulerCore, n: int, now: float = 0.0) -> list[str]:
    for i in range(n):
        admit(s, ticket(f"bulk{i}", at=now, traffic_class=BULK, max_tokens=500), now)
    return ids(s.poll(now).started)


def test_without_chats_bulk_fills_the_engine_to_its_knee() -> None:
    s = calibrated()
    assert s.bulk_cap.knee() == 32
    assert len(flood(s, 40)) == 32
    assert s.bulk_allowed(0.0) == 32
    assert s.queue_depth(BULK) == 8


def test_the_cap_falls_back_to_the_budget_when_it_is_switched_off() -> None:
    s = calibrated(cap_bulk=False)
    assert len(flood(s, 100)) == 80  # bulk's share of 100 sequences (20% is the reserve)


def test_a_chat_stops_the_bulk_beyond_the_gap_target_cheapest_to_resume_first() -> None:
    s = calibrated()
    flood(s, 32)
    # Each bulk request has generated i tokens: its prompt (10) plus those, past the last full
    # 16-token block, is what the engine must compute again if it stops.
    for i in range(32):
        s.generated(f"bulk{i}", i, 0.5)
    admit(s, ticket("chat", at=1.0))
    step = s.poll(1.0)
    assert ids(step.started) == ["chat"]
    assert s.bulk_allowed(1.0) == 9  # 10 sequences fit 5.4 ms, less the chat
    victims = ids(step.preempted)
    assert len(victims) == 23
    cost = {f"bulk{i}": (10 + i) % BLOCK for i in range(32)}
    kept = set(cost) - set(victims)
    assert max(cost[v] for v in victims) <= min(cost[k] for k in kept)
    assert s.poll(1.0).preempted == []  # each named once
    assert s.preempted_for[PreemptCause.STEP_OVER_TARGET] == 23  # (no feedback: the model)


def test_paused_bulk_waits_out_the_chats_and_the_hold_then_resumes_first() -> None:
    s = calibrated(bulk_hold_ms=1000)
    flood(s, 36)  # 32 run, 4 wait
    admit(s, ticket("chat", at=1.0, max_tokens=32))
    victims = ids(s.poll(1.0).preempted)
    for rid in victims:
        s.generated(rid, 7, 1.0)
        continuation = s.requeue(rid, 1.0)
        assert continuation is not None
        assert (continuation.prompt_tokens, continuation.max_tokens) == (17, 493)
        assert continuation.resumed_tokens == 7
    assert s.poll(1.0).started == []  # capped while the chat runs
    s.release("chat", 1.2, completed=True)
    step = s.poll(1.2)
    assert step.started == []  # the hold: still room for one chat, so nothing grows
    assert step.wake_at == pytest.approx(2.2)
    assert s.poll(2.19).started == []
    step = s.poll(2.2)
    assert len(step.started) == 23  # back to the knee, the paused requests first
    assert set(ids(step.started)) == set(victims)


def test_the_hold_restarts_with_each_chat() -> None:
    s = calibrated(bulk_hold_ms=1000)
    flood(s, 40)
    admit(s, ticket("chat1", at=1.0))
    for rid in ids(s.poll(1.0).preempted):
        s.requeue(rid, 1.0)
    s.release("chat1", 1.5, completed=True)
    admit(s, ticket("chat2", at=2.0))  # inside the hold: nothing to preempt, no growth
    step = s.poll(2.0)
    assert ids(step.started) == ["chat2"] and step.preempted == []
    s.release("chat2", 2.3, completed=True)
    assert s.poll(2.3).started == []
    assert s.poll(3.29).started == []
    assert len(s.poll(3.3).started) == 32 - 9


def test_a_steady_stream_of_chats_keeps_bulk_capped_in_the_quiet_between_them() -> None:
    s = calibrated(bulk_hold_ms=1000)
    flood(s, 40)
    for i in range(40):  # four chats a second for ten seconds, each done in 0.1 s
        at = 1.0 + i / 4
        admit(s, ticket(f"chat{i}", at=at))
        for rid in ids(s.poll(at).preempted):
            s.requeue(rid, at)
        s.release(f"chat{i}", at + 0.1, completed=True)
    quiet_from = 1.0 + 39 / 4 + 0.1
    assert s.estimates.chat_rate(quiet_from) > 2.0  # (4/s, averaged over 10 s from none)
    # A second after the last chat (the hold), chats are still expected every third of a
    # second or so: bulk stays at the chats' cap, with nothing to stop when the next comes.
    step = s.poll(quiet_from + 1.0)
    assert step.started == []
    assert s.bulk_allowed(quiet_from + 1.0) == 9
    # It grows once their rate has decayed to one per hold: 10 s x log(rate x 1 s) later.
    assert step.wake_at is not None and step.wake_at > quiet_from + 5.0
    assert s.estimates.chat_rate(step.wake_at) == pytest.approx(1.0)
    assert s.poll(step.wake_at - 0.01).started == []
    assert len(s.poll(step.wake_at).started) == 32 - 9


def test_bulk_just_over_the_cap_is_left_to_finish_rather_than_preempted() -> None:
    s = calibrated()
    flood(s, 9)  # exactly the cap with one chat
    admit(s, ticket("chat1", at=1.0))
    assert ids(s.poll(1.0).started) == ["chat1"]
    admit(s, ticket("chat2", at=1.1))
    step = s.poll(1.1)
    # The cap is 8 now, but 11 sequences take 5.5 ms, over the cap's aim and within the 6 ms
    # target: a preempted request would cost more in prefill than a step saves. No new bulk.
    assert ids(step.started) == ["chat2"] and step.preempted == []
    s.release("bulk0", 1.2, completed=True)
    admit(s, ticket("bulk-new", at=1.2, traffic_class=BULK))
    assert s.poll(1.2).started == []


def test_bulk_keeps_its_minimum_share_however_many_chats_run() -> None:
    s = calibrated()
    flood(s, 32)
    for n in range(30):
        admit(s, ticket(f"chat{n}", at=1.0))
    step = s.poll(1.0)
    assert len(step.started) == 30
    # 30 chats leave bulk nothing under the cap's 5.4 ms aim (10 sequences); it keeps a tenth
    # of those 10, and at least one.
    assert s.bulk_allowed(1.0) == 1
    assert len(step.preempted) == 32 - 1
    wide = calibrated(interactive={"itl_ms": 24})  # 55 sequences fit 21.6 ms: bulk keeps 5
    flood(wide, 32)
    for n in range(60):
        admit(wide, ticket(f"chat{n}", at=1.0))
    wide.poll(1.0)
    assert wide.bulk_allowed(1.0) == 5


def test_a_gap_target_in_milliseconds_overrides_the_idle_multiple() -> None:
    s = calibrated()
    assert s.bulk_cap.targets().itl_s == pytest.approx(0.006)
    assert s.bulk_cap.targets().ttft_s == pytest.approx(0.030)
    s = core(
        config(slo={"interactive": {"itl_ms": 8, "ttft_ms": 100}}),
        tokens=10**6,
        kv_blocks=10**6,
        sequences=100,
        block_size=BLOCK,
    )
    for n, step_ms in CPU_STEPS_MS.items():
        s.estimates.steps.observe(n, step_ms / 1000)
    assert (s.bulk_cap.targets().itl_s, s.bulk_cap.targets().ttft_s) == (0.008, 0.1)
    assert s.bulk_cap.with_chats(1) == 13  # 90% of 8 ms is 14 sequences, less the chat


def test_the_ttft_target_bounds_how_far_bulk_grows_with_no_chat_about() -> None:
    # A slow first token on an idle engine (2 ms): TTFT target 6 ms, so a step may take 4 ms at
    # most, 8 sequences, though the knee is 32: a chat arriving mid-step still starts in time.
    s = calibrated()
    s.estimates.engine_ttft_s = 0.002
    assert s.bulk_cap.idle() == 8


def test_the_default_ttft_target_counts_the_frontends_lead_in() -> None:
    # Chats read for 5 ms before the scheduler sees them: on an idle server their first token
    # comes 5 ms before the engine's 10 ms, and the target is 3x both, not 3x the engine's.
    s = calibrated()
    assert s.bulk_cap.targets().ttft_s == pytest.approx(0.030)
    admit(s, ticket("chat", at=1.0), 1.005)
    assert s.bulk_cap.targets().ttft_s == pytest.approx(0.045)
    # A later chat read faster moves it part of the way (the estimates' smoothing, 0.2).
    admit(s, ticket("chat2", at=2.0), 2.0)
    assert s.bulk_cap.targets().ttft_s == pytest.approx(3 * (0.010 + 0.8 * 0.005))


def test_only_first_tokens_late_behind_a_bulk_prefill_slow_the_pace() -> None:
    # TTFT target 30 ms (3x the idle 10 ms); a first token 40 ms after the chat's dispatch is
    # late in the engine. Behind a bulk prefill it slows bulk's pace; with none under way in
    # its wait, slowing bulk's starts could not have brought it in, and it counts as on time.
    s = calibrated(feedback=True)
    assert s.bulk_cap.targets().ttft_s == pytest.approx(0.030)
    assert len(flood(s, 2, now=1.0)) == 2
    admit(s, ticket("behind bulk", at=1.0))
    assert ids(s.poll(1.0).started) == ["behind bulk"]
    s.generated("behind bulk", 1, 1.04)
    s.poll(1.5)  # the controller's next period
    slowed = s.controller.pace
    assert slowed < 1.0
    admit(s, ticket("no bulk start", at=5.0))
    assert ids(s.poll(5.0).started) == ["no bulk start"]
    s.generated("no bulk start", 1, 5.04)
    s.poll(5.5)
    assert s.controller.pace > slowed


def test_on_a_gpu_shaped_engine_chats_cap_nothing() -> None:
    # Steps stay flat until compute saturates: the gap target (3 x 20 ms) fits every sequence
    # the budget allows, and the knee lies beyond it.
    gpu = {1: 20.0, 8: 20.5, 32: 21.0, 64: 22.0, 128: 30.0, 256: 58.0}
    s = calibrated(gpu)
    s.estimates.engine_ttft_s = 0.040  # a step and a prefill
    assert s.bulk_cap.idle() == 80
    assert s.bulk_cap.with_chats(5) == 80
    flood(s, 80)
    admit(s, ticket("chat", at=1.0))
    step = s.poll(1.0)
    assert ids(step.started) == ["chat"] and step.preempted == []


def test_bulk_prefill_is_paced_to_what_one_step_has_room_for() -> None:
    # Prompts of 100 tokens at 2,000 tokens/s: 50 ms of prefill each, more than the 20 ms a
    # step may add with no chat about (TTFT target 30 ms, idle TTFT 10 ms). Beyond bulk's floor
    # (1), each goes alone into a step, 50 ms longer for it, and the next waits for that step
    # and one more.
    s = calibrated()
    s.estimates.prefill_tokens_per_s = 2000
    for i in range(32):
        admit(s, ticket(f"bulk{i}", traffic_class=BULK, prompt=100, max_tokens=400))
    step = s.poll(0.0)
    assert len(step.started) == 2  # the floor (a tenth of 12 sequences, at least 1), one paced
    now, starts = 0.0, []
    while s.running_count(BULK) < 32:
        assert step.wake_at is not None and step.wake_at > now
        running = s.running_count(BULK)
        now = step.wake_at
        step = s.poll(now)
        starts.append((now, len(step.started), running))
    assert all(count == 1 for _, count, _ in starts)
    for (before, _, running), (after, _, _) in itertools.pairwise(starts):
        # (Within a quarter: the step grows with each start, and refills run at its new pace.)
        wait = 0.050 + s.estimates.steps.at(running + 1)
        assert wait <= after - before <= 1.25 * wait


def test_small_prefills_share_a_step() -> None:
    # Continuations of 17 tokens (10 + 7) need 1 token past their last full block: 0.5 ms each
    # at 2,000 tokens/s; the 20 ms of headroom takes many of them in the same step.
    s = calibrated()
    flood(s, 32)
    admit(s, ticket("chat", at=1.0))
    for rid in ids(s.poll(1.0).preempted):
        s.generated(rid, 7, 1.0)
        s.requeue(rid, 1.0)
    s.estimates.prefill_tokens_per_s = 2000
    s.release("chat", 1.1, completed=True)
    s.poll(1.1)
    assert len(s.poll(2.1).started) > 15  # of the 23 paused


def test_bulk_that_ends_together_restarts_one_step_apart_while_chats_are_about() -> None:
    # Bulk of one length started together ends together (closed-loop clients, a batch's
    # lines). Its replacements must not all start in the step where a chat arrives: their
    # prefills, and the server's work on each new request, would share it. With a chat about,
    # they start one engine step apart (beyond bulk's guaranteed share, 2 of 100 sequences),
    # and so end apart in turn.
    s = core(
        config(budgets={"bulk_min_share": 0.02}),
        tokens=10**6,
        kv_blocks=10**6,
        sequences=100,
        block_size=BLOCK,
    )
    for n, step_ms in CPU_STEPS_MS.items():
        s.estimates.steps.observe(n, step_ms / 1000)
    s.estimates.observe_engine_ttft(IDLE_TTFT_S)
    admit(s, ticket("chat", at=0.0, max_tokens=10_000))
    assert ids(s.poll(0.0).started) == ["chat"]
    cohort = s.bulk_allowed(0.0)
    assert cohort == 9
    for i in range(2 * cohort):
        admit(s, ticket(f"bulk{i}", at=0.0, traffic_class=BULK, max_tokens=500), 0.0)
    now, step = 0.0, s.poll(0.0)
    while s.running_count(BULK) < cohort:  # the first cohort, spread as it fills
        assert step.wake_at is not None
        now, step = step.wake_at, s.poll(step.wake_at)
    for i in range(cohort):
        s.release(f"bulk{i}", 1.0, completed=True)
    now, step = 1.0, s.poll(1.0)
    starts = [(now, len(step.started))]
    while s.running_count(BULK) < cohort:
        assert step.wake_at is not None and step.wake_at > now
        now, step = step.wake_at, s.poll(step.wake_at)
        starts.append((now, len(step.started)))
    assert sum(count for _, count in starts) == cohort
    assert starts[0][1] == 2  # bulk's guaranteed share, at once
    paced = [at for at, count in starts[1:] if count]
    assert len(paced) == cohort - 2  # then one at a time, each a step after the one before
    for before, after in itertools.pairwise(paced):
        assert after - before >= s.estimates.steps.at(1.0)


def test_with_no_chat_about_a_cohort_of_bulk_restarts_at_once() -> None:
    s = calibrated()
    flood(s, 64)
    for i in range(32):
        s.release(f"bulk{i}", 1.0, completed=True)
    assert len(s.poll(1.0).started) == 32


def two_chats_at_a_time_for_a_minute(s: SchedulerCore, now: float) -> float:
    """Two chats at a time, back to back: on average two run together. Returns the time after."""
    for n in range(600):
        admit(s, ticket(f"chat{n}a", at=now))
        admit(s, ticket(f"chat{n}b", at=now))
        s.poll(now)
        now += 0.1
        s.release(f"chat{n}a", now, completed=True)
        s.release(f"chat{n}b", now, completed=True)
    return now


def test_bulk_leaves_room_for_the_chats_that_usually_run_together() -> None:
    s = calibrated()
    flood(s, 9)
    now = two_chats_at_a_time_for_a_minute(s, 1.0)
    assert round(s.estimates.chats_together) == 2
    admit(s, ticket("one", at=now))
    s.poll(now)
    # 10 sequences fit the cap's aim; the chat running, and two more expected: 7 for bulk.
    assert s.bulk_allowed(now) == 10 - 1 - 2


@pytest.mark.parametrize(("measured", "stopped"), [(1.1, 0), (1.3, 3)])
def test_under_feedback_bulk_over_the_cap_is_stopped_only_for_chats_measured_far_over(
    measured: float, stopped: int
) -> None:
    s = calibrated(feedback=True)
    flood(s, 12)  # no chat about: all 12 run
    for i in range(2 * MIN_GAPS):
        s.meter.gap(measured, 1.0 - i / 1000)
    admit(s, ticket("chat", at=1.0))
    step = s.poll(1.0)
    assert ids(step.started) == ["chat"]
    # Room for one chat: 9 bulk. 13 sequences take a predicted 6.5 ms, within 1.2x the 6 ms
    # target: the model stops nothing. Chats measured a little over their target leave bulk to
    # end by itself (each stop costs a prefill chats wait behind); far over, it stops at once.
    assert s.bulk_allowed(1.0) == 9
    assert len(step.preempted) == stopped
    assert s.preempted_for == {**dict.fromkeys(PreemptCause, 0), "chats_far_over": stopped}


def test_under_feedback_the_cap_leaves_room_for_the_usual_chats_and_for_each_of_a_burst() -> None:
    s = calibrated(feedback=True)
    flood(s, 20)
    now = two_chats_at_a_time_for_a_minute(s, 1.0)
    assert s.controller.scale == 1.0  # no gap was reported: nothing to correct
    # Room for the two chats that usually run, whether one runs at the moment or one more than
    # usual: a bulk request outlives many chats, and a cap that followed each would ratchet up
    # to its highest. Beyond that, a burst: each chat more takes a bulk sequence's room.
    for chats, allowed in ((1, 8), (3, 8), (4, 7), (6, 5)):
        for i in range(chats):
            admit(s, ticket(f"now{chats}.{i}", at=now))
        s.poll(now)
        assert s.bulk_allowed(now) == allowed
        for i in range(chats):
            s.release(f"now{chats}.{i}", now, completed=True)


def test_under_feedback_a_burst_of_chats_stops_a_bulk_sequence_for_each_chat_beyond_the_usual() -> (
    None
):
    s = calibrated(feedback=True)
    assert len(flood(s, 8)) == 8  # with two chats about, 8 is the cap: bulk stays at it
    now = two_chats_at_a_time_for_a_minute(s, 1.0)
    assert s.running_count(BULK) == 8
    assert sum(s.preempted_for.values()) == 0
    for i in range(3):  # one more than usual: not a burst
        admit(s, ticket(f"three{i}", at=now))
    assert s.poll(now).preempted == []
    for i in range(3):
        s.release(f"three{i}", now, completed=True)
    for i in range(5):  # two more than that
        admit(s, ticket(f"five{i}", at=now))
    step = s.poll(now)
    assert len(step.preempted) == 2
    assert s.preempted_for == {**dict.fromkeys(PreemptCause, 0), "chat_burst": 2}


def test_under_feedback_a_burst_onto_bulk_grown_far_over_the_cap_stops_all_that_is_over() -> None:
    s = calibrated(feedback=True)
    assert len(flood(s, 20)) == 20  # no chat about: bulk grew
    for i in range(4):  # a burst: room for 7 bulk, and 24 sequences are a step far over
        admit(s, ticket(f"chat{i}", at=1.0))
    step = s.poll(1.0)
    assert s.bulk_allowed(1.0) == 7
    # The model's step far over the target stops all that is over the cap, not only a
    # sequence for each chat of the burst.
    assert len(step.preempted) == 13
    assert s.preempted_for == {**dict.fromkeys(PreemptCause, 0), "step_over_target": 13}


def test_a_request_is_named_once_when_both_causes_preempt_in_one_poll() -> None:
    # One bulk sequence budget beyond the chats', no reserve, preemption for a waiting chat
    # after 0 ms: a chat arriving when bulk fills every seat is over the cap and waiting.
    s = core(
        config(
            budgets={
                "interactive_reserve_share": 0.0,
                "bulk_min_share": 0.0,
                "preempt_bulk_after_ms": 0,
            }
        ),
        tokens=10**6,
        kv_blocks=10**6,
        sequences=32,
        block_size=BLOCK,
    )
    for n, step_ms in CPU_STEPS_MS.items():
        s.estimates.steps.observe(n, step_ms / 1000)
    s.estimates.observe_engine_ttft(IDLE_TTFT_S)
    assert len(flood(s, 32)) == 32
    admit(s, ticket("chat", at=1.0))
    victims = ids(s.poll(1.0).preempted)
    assert len(victims) == len(set(victims)) == 32 - s.bulk_allowed(1.0)


def on_adapters(slo: dict[str, object] | None = None) -> SchedulerCore:
    """The CPU engine with two adapter slots, serving an adapter "a" whose steps cost twice the
    base model's (its first token 1.5x), and its bulk flooding on "a" too."""
    s = core(
        config(slo={"feedback": False, **(slo or {})}),
        tokens=10**6,
        kv_blocks=10**6,
        sequences=100,
        block_size=BLOCK,
        adapter_slots=2,
    )
    for n, step_ms in CPU_STEPS_MS.items():
        s.estimates.steps.observe(n, step_ms / 1000)
    s.estimates.observe_engine_ttft(IDLE_TTFT_S)
    s.estimates.adapters["a"] = AdapterCost(step=2.0, ttft=1.5)
    for i in range(32):
        admit(s, ticket(f"bulk{i}", traffic_class=BULK, max_tokens=500, adapter="a"))
    s.poll(0.0)
    return s


def test_a_chat_on_an_adapter_is_judged_by_its_adapters_idle_step() -> None:
    s = on_adapters()
    chat = ticket("chat", at=1.0, adapter="a")
    targets = s.targets_for(chat)
    assert (targets.itl_s, targets.ttft_s) == (pytest.approx(0.012), pytest.approx(0.045))
    base = s.targets_for(ticket("base chat", at=1.0))
    assert (base.itl_s, base.ttft_s) == (pytest.approx(0.006), pytest.approx(0.030))
    # Every step runs the adapter, at twice the base model's: its chat's 12 ms target allows
    # what the base model's 6 ms allows on the base model's steps, 10 sequences, less the chat.
    admit(s, chat)
    s.poll(1.0)
    assert s.bulk_allowed(1.0) == 9
    # A chat on the base model beside it holds bulk to the steps its own 6 ms allows on the
    # adapter's: 3.4 sequences (2.7 ms of the base model's), less the two chats.
    admit(s, ticket("base chat", at=1.0))
    s.poll(1.0)
    assert s.bulk_allowed(1.0) == 1


def test_a_target_in_milliseconds_holds_for_chats_on_an_adapter_too() -> None:
    s = on_adapters({"interactive": {"itl_ms": 8, "ttft_ms": 100}})
    targets = s.targets_for(ticket("chat", at=1.0, adapter="a"))
    assert (targets.itl_s, targets.ttft_s) == (0.008, 0.1)
