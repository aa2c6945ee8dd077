"""The decode step-time estimate: observed bins, interpolation, and cautious extrapolation."""

from __future__ import annotations

import itertools

import pytest

from server.core.config import parse_config
from server.scheduler.estimates import AdapterCost, RateEstimates, StepTimes


def test_the_prior_stands_until_anything_is_observed() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    assert steps.at(1) == steps.at(100) == 0.01


def test_between_observed_concurrencies_the_step_time_is_interpolated() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    steps.observe(8, 0.010)
    steps.observe(32, 0.022)
    assert steps.at(8) == pytest.approx(0.010)
    assert steps.at(20) == pytest.approx(0.016)
    assert steps.at(32) == pytest.approx(0.022)


def test_extrapolation_never_assumes_the_engine_gets_faster() -> None:
    steps = StepTimes(prior_step_s=0.001, weight=0.5)
    steps.observe(8, 0.010)
    steps.observe(32, 0.022)
    assert steps.at(1) == pytest.approx(0.010)  # fewer sequences: no faster than seen
    # More sequences than ever seen: the engine's total token rate is assumed not to grow.
    assert steps.at(64) == pytest.approx(0.044)


def test_each_concurrency_bin_is_a_moving_average() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    steps.observe(16, 0.020)
    steps.observe(16, 0.030)  # same bin: blended, not replaced
    assert steps.at(16) == pytest.approx(0.025)
    steps.observe(17, 0.025)  # 16 and 17 share a half-octave bin
    assert steps.at(16.5) == pytest.approx(0.025)


def test_within_finds_the_most_sequences_whose_step_fits() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    assert steps.within(0.02) == float("inf")  # nothing observed: the flat prior fits any
    assert steps.within(0.005) == 0.0
    steps.observe(1, 0.002)
    steps.observe(8, 0.004)
    steps.observe(16, 0.008)
    assert steps.within(0.001) == 0.0  # even one sequence is slower
    assert steps.within(0.006) == pytest.approx(12)  # interpolated
    assert steps.within(0.016) == pytest.approx(32)  # beyond: steps grow with concurrency


def test_the_knee_is_where_more_sequences_stop_adding_throughput() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    assert steps.knee(0.95) is None
    # Tokens/s: 500, 2000, 2000, 2667, 2560.
    for n, step in {1: 0.002, 8: 0.004, 16: 0.008, 32: 0.012, 64: 0.025}.items():
        steps.observe(n, step)
    assert steps.knee(0.95) == pytest.approx(32)
    assert steps.knee(0.7) == pytest.approx(8)


def test_while_throughput_still_grows_at_the_top_the_knee_lies_beyond_it() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    steps.observe(8, 0.004)
    steps.observe(16, 0.006)  # the best rate yet, at the most sequences seen: try twice that
    assert steps.knee(0.95) == pytest.approx(32)


def churn(estimates: RateEstimates, now: float, step_s: float, seconds: float) -> float:
    """A bulk request with chats coming and going: 1, 2, 3, 2, ... sequences, each for 100 ms
    of steps of `step_s`. Returns the time at the end."""
    mix = itertools.cycle([1, 2, 3, 2])
    for running in itertools.islice(mix, round(seconds / 0.1)):
        estimates.running_changed(running, now)
        for _ in range(round(0.1 / step_s)):
            now += step_s
            estimates.tokens_generated(running, now)
    return now


def test_chats_coming_and_going_at_a_few_sequences_keep_the_estimate_current() -> None:
    # One chat doubles a level of one or two sequences; the window must not restart at each,
    # or a stall seen there (a shared host's) would stand for good, and the bulk cap with it.
    estimates = RateEstimates(parse_config({}).estimates)
    now = churn(estimates, 0.0, step_s=0.025, seconds=4.0)
    assert estimates.steps.at(2.0) == pytest.approx(0.025, rel=0.1)
    churn(estimates, now, step_s=0.005, seconds=10.0)
    assert estimates.steps.at(2.0) == pytest.approx(0.005, rel=0.1)


def test_a_stall_seen_where_the_engine_no_longer_runs_fades_and_the_knee_tries_there_again() -> (
    None
):
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    steps.observe(8, 0.004)  # 2,000 tokens/s
    steps.observe(32, 0.050)  # 640 tokens/s: a stall of the host, once
    assert steps.knee(0.95) == pytest.approx(8)
    for _ in range(10):  # the cap holds the engine at 8 sequences, and it runs as before
        steps.observe(8, 0.004)
    assert steps.at(32) == pytest.approx(0.016, rel=0.01)  # 2,000 tokens/s, no more
    assert steps.knee(0.95) == pytest.approx(64)  # the best rate at the top: try beyond


def test_a_rate_seen_falling_after_the_lower_levels_stands() -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.5)
    steps.observe(8, 0.004)
    steps.observe(32, 0.020)  # seen after 8: 1,600 tokens/s against 2,000
    assert steps.at(32) == pytest.approx(0.020)
    assert steps.knee(0.95) == pytest.approx(8)


SIM_STEPS = {1: 0.0053, 8: 0.0055, 16: 0.0057, 32: 0.0070}  # the sim engine of seat_flood.py


def test_one_window_of_a_host_freezing_the_server_moves_the_step_time_a_little() -> None:
    # Seen on a shared host: a 3 s step with 18 ms of the server's CPU, a window of 31
    # sequences and three tokens. Taken as it came, it made the step at 31 sequences 5.6 s and
    # the bulk cap fell from 25 to 12 sequences at once, then lower with each freeze after.
    steps = StepTimes(prior_step_s=0.01, weight=0.2)
    for n, step_s in SIM_STEPS.items():
        steps.observe(n, step_s)
    before = steps.at(31)
    steps.observe(31, 3.2 * 31 / 3)
    assert before < steps.at(31) <= 1.25 * before
    assert steps.within(0.0144) > 32  # the gap target's aim still fits every seat


def test_sequences_cancelled_before_the_engine_ran_them_teach_no_step_time() -> None:
    # Seen in a WebSocket race of 1,000 generate+cancel pairs on a starved host: 116 sequences
    # dispatched and cancelled before the engine stepped them, 2 tokens in the window's 0.6 s.
    # Read as a step, it was 35-63 s at 116 sequences, and (the curve's only point) at one
    # sequence too: the next request's 6 tokens were refused as unmeetable (380 s).
    estimates = RateEstimates(parse_config({}).estimates)
    estimates.running_changed(116, 0.0)
    for now in (0.3, 0.6, 0.65):
        estimates.tokens_generated(1, now)
    estimates.running_changed(0, 0.7)  # their aborts
    assert estimates.steps.revision == 0
    # Four sequences decoding in steps of 10 ms: their window is a step time.
    now = 1.0
    estimates.running_changed(4, now)
    for _ in range(60):
        now += 0.010
        estimates.tokens_generated(4, now)
    assert estimates.steps.at(1) == pytest.approx(0.010)


@pytest.mark.parametrize("slower", [2.0, 5.0])
def test_an_engine_that_really_slows_down_is_learnt_within_a_few_windows(slower: float) -> None:
    steps = StepTimes(prior_step_s=0.01, weight=0.2)
    for n, step_s in SIM_STEPS.items():
        steps.observe(n, step_s)
    for _ in range(14):  # 7 s of engine time
        steps.observe(32, slower * 0.0070)
    assert steps.at(32) == pytest.approx(slower * 0.0070, rel=0.1)


def test_steps_over_an_adapters_sequences_teach_the_base_models_step_time() -> None:
    # An adapter whose steps cost twice the base model's: 8 sequences on it for 2 s of 8 ms
    # steps teach the base model's 4 ms, and its prediction for them is 8 ms again; once they
    # have left, the base model's own.
    estimates = RateEstimates(parse_config({}).estimates)
    estimates.adapters["a"] = AdapterCost(step=2.0, ttft=1.5)
    now = 0.0
    estimates.running_changed(8, now, ["a"])
    for _ in range(250):
        now += 0.008
        estimates.tokens_generated(8, now)
    assert estimates.steps.at(8) == pytest.approx(0.004)
    assert estimates.step_s(8) == pytest.approx(0.008)
    estimates.running_changed(8, now, [])
    assert estimates.step_s(8) == pytest.approx(0.004)
    # A first token on it, on a nearly idle engine, is the base model's at its cost less.
    estimates.observe_engine_ttft(0.015, "a")
    assert estimates.engine_ttft_s == pytest.approx(0.010)
    assert estimates.idle_ttft_on(estimates.adapter_cost("a")) == pytest.approx(0.015)
