"""Trace parsing and generated arrivals."""

from __future__ import annotations

import pytest

from server.scheduler.types import TrafficClass
from server.simulation.workload import TraceError, parse_trace, poisson_arrivals


def test_trace_times_and_absolute_deadlines_are_in_ms() -> None:
    a, e, b = parse_trace("A@0,B@7,E@1:deadline=150")
    assert (a.id, a.time_s, a.deadline_s) == ("A", 0.0, None)
    assert (e.id, e.time_s, e.deadline_s) == ("E", 0.001, 0.15)
    assert (b.id, b.time_s) == ("B", 0.007)


def test_trace_options() -> None:
    (x,) = parse_trace("X@2:class=bulk:tenant=acme:model=m2:max_tokens=9:prompt=POISON")
    assert (x.traffic_class, x.tenant, x.model, x.max_tokens, x.prompt) == (
        TrafficClass.BULK,
        "acme",
        "m2",
        9,
        "POISON",
    )


@pytest.mark.parametrize("bad", ["A", "A@-1", "A@0:colour=red", "A@0,A@1", "A@0:deadline"])
def test_bad_traces_are_refused(bad: str) -> None:
    with pytest.raises(TraceError):
        parse_trace(bad)


def test_poisson_arrivals_are_seeded_and_ordered() -> None:
    first = list(poisson_arrivals(100, 5.0, seed=7, relative_deadline_s=0.2))
    assert first == list(poisson_arrivals(100, 5.0, seed=7, relative_deadline_s=0.2))
    assert 350 < len(first) < 650
    times = [a.time_s for a in first]
    assert times == sorted(times) and times[-1] < 5.0
    assert all(a.deadline_s == pytest.approx(a.time_s + 0.2) for a in first)
