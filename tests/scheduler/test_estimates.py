"""The decode step-time estimate: observed bins, interpolation, and cautious extrapolation."""

from __future__ import annotations

import pytest

from server.scheduler.estimates import StepTimes


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
