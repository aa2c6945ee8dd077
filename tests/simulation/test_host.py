"""The simulated host's noisy neighbour: a speed that wanders by the sigma it is given, and
changes over the time it is given, whatever reads it."""

from __future__ import annotations

import math
import statistics

import pytest
from pydantic import ValidationError

from server.simulation.host import Host, HostConfig


def log_factors(host: Host, every_s: float, reads: int) -> list[float]:
    return [math.log(host.factor(i * every_s)) for i in range(1, reads + 1)]


def correlation(xs: list[float], lag: int) -> float:
    return statistics.correlation(xs[:-lag], xs[lag:])


def test_without_a_neighbour_the_host_is_the_engine_until_it_slows_down() -> None:
    host = Host(HostConfig(slowdown_at_s=10.0, slowdown=2.0))
    assert [host.factor(t) for t in (0.0, 5.0, 10.0, 20.0)] == [1.0, 1.0, 2.0, 2.0]


def test_a_neighbour_wanders_by_its_sigma_and_changes_over_its_time() -> None:
    host = Host(HostConfig(drift=0.2, drift_s=1.0, seed=3))
    logs = log_factors(host, 0.1, 20_000)  # 2,000 s, read ten times a second
    assert 0.17 < statistics.pstdev(logs) < 0.23
    # A mean of 1: as fast on average as the host without it.
    assert abs(statistics.fmean(math.exp(x) for x in logs) - 1.0) < 0.03
    # A tenth of its time apart, nearly the same; five times its time apart, unrelated.
    assert correlation(logs, 1) > 0.85
    assert abs(correlation(logs, 50)) < 0.1


def test_how_often_the_neighbour_is_read_does_not_change_how_it_wanders() -> None:
    often = log_factors(Host(HostConfig(drift=0.2, drift_s=1.0, seed=5)), 0.01, 200_000)
    rarely = log_factors(Host(HostConfig(drift=0.2, drift_s=1.0, seed=5)), 1.0, 2_000)
    for logs in (often[99::100], rarely):  # both once a second
        assert 0.17 < statistics.pstdev(logs) < 0.23
        assert 0.28 < correlation(logs, 1) < 0.46  # exp(-1), its correlation a second apart


def test_a_neighbour_slows_a_host_that_slowed_down_as_much_again() -> None:
    calm = Host(HostConfig(drift=0.2, seed=7))
    slowed = Host(HostConfig(drift=0.2, seed=7, slowdown_at_s=0.0, slowdown=2.0))
    assert [slowed.factor(t) for t in (1.0, 2.0)] == [2 * calm.factor(t) for t in (1.0, 2.0)]


def test_a_neighbour_that_grows_with_the_load_wanders_more_behind_steps_that_write_more() -> None:
    def wander(outputs: int) -> float:
        host = Host(HostConfig(drift=0.05, drift_per_output=0.01, drift_s=1.0, seed=11))
        host.write(outputs, 0.0)  # each step writes this many outputs
        return statistics.pstdev(log_factors(host, 0.1, 20_000))

    # The sigma is 0.05 with nothing written, and 0.01 more per output of the last step.
    for outputs, sigma in ((0, 0.05), (5, 0.10), (15, 0.20)):
        assert 0.85 * sigma < wander(outputs) < 1.15 * sigma


def test_a_neighbour_that_grows_with_the_load_needs_a_neighbour() -> None:
    with pytest.raises(ValidationError, match="set drift too"):
        HostConfig(drift_per_output=0.01)
