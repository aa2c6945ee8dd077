"""Which of a batch's pending lines start (`Turns`), in virtual time: lines that share a key
(a conversation) run one at a time, in the file's order, and a key refused for now waits its
time while the other lines go on."""

from __future__ import annotations

import pytest

from server.batch_api.lines import Turns
from server.batch_api.store import Line

pytestmark = pytest.mark.unit


def pending(*keys: str | None) -> list[tuple[Line, str | None]]:
    return [(Line(index, f"req-{index}", {}), key) for index, key in enumerate(keys)]


def indices(chosen: list[tuple[Line, str | None]]) -> list[int]:
    return [line.index for line, _ in chosen]


def test_a_keys_first_line_starts_and_the_lines_after_it_wait() -> None:
    turns = Turns()
    lines = pending("a", None, "a", "b", "a", None)
    chosen = turns.startable(lines, now=0.0, seats=10)
    assert indices(chosen) == [0, 1, 3, 5]
    for _, key in chosen:
        turns.started(key)
    # Line 0 ends: "a"'s next line (2) is its first pending one; "b" still runs.
    turns.ended("a")
    assert indices(turns.startable(pending("a", "b", "a")[1:], now=1.0, seats=10)) == [2]


def test_seats_bound_what_starts() -> None:
    turns = Turns()
    assert indices(turns.startable(pending(None, "a", None, "b"), now=0.0, seats=2)) == [0, 1]


def test_a_key_refused_for_now_waits_its_time_and_the_others_go_on() -> None:
    turns = Turns()
    turns.started("a")
    turns.ended("a", retry_at=5.0)
    lines = pending("a", "b", "a", None)
    assert indices(turns.startable(lines, now=1.0, seats=10)) == [1, 3]
    assert turns.next_time(1.0) == 5.0
    # At its time, its first line again (not the one after it).
    assert indices(turns.startable(lines, now=5.0, seats=10)) == [0, 1, 3]
    assert turns.next_time(5.0) is None


def test_a_key_started_again_forgets_its_wait() -> None:
    turns = Turns()
    turns.ended("a", retry_at=5.0)
    turns.started("a")
    turns.ended("a")
    assert turns.next_time(0.0) is None
    assert indices(turns.startable(pending("a"), now=0.0, seats=1)) == [0]
