"""The discrete-event loop: callbacks in time order, ties in scheduling order, fed streams."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from server.simulation.events import EventLoop


def test_fed_events_sort_where_scheduling_them_all_at_once_would_have_put_them() -> None:
    ran: list[str] = []
    loop = EventLoop()

    def record(name: str) -> Callable[[], None]:
        return lambda: ran.append(name)

    def schedule_later() -> None:
        loop.call_at(1.0, record("later"))

    loop.call_at(1.0, record("before"))
    loop.feed([(0.5, "a"), (1.0, "b")], ran.append)
    loop.call_at(1.0, record("after"))
    loop.call_at(0.5, schedule_later)
    loop.run()
    assert ran == ["a", "before", "b", "after", "later"]


def test_a_fed_stream_is_read_only_as_the_loop_reaches_it() -> None:
    read: list[float] = []

    ran: list[float] = []

    def stream() -> Iterator[tuple[float, float]]:
        for t in (1.0, 2.0, 3.0):
            read.append(t)
            yield t, t

    loop = EventLoop()
    loop.feed(stream(), ran.append)
    assert read == [1.0]
    loop.run(until=2.5)
    assert (read, ran, loop.now) == ([1.0, 2.0, 3.0], [1.0, 2.0], 2.5)


def test_a_fed_stream_out_of_time_order_is_an_error() -> None:
    loop = EventLoop()
    loop.feed([(2.0, None), (1.0, None)], lambda _: None)
    with pytest.raises(ValueError, match="out of time order"):
        loop.run()


def test_a_cancelled_event_does_not_run() -> None:
    ran: list[str] = []
    loop = EventLoop()
    handle = loop.call_at(1.0, lambda: ran.append("x"))
    handle.cancel()
    loop.run()
    assert ran == []


def test_cancelled_events_leave_the_heap_and_the_rest_keep_their_order() -> None:
    # A simulator cancels most deadlines it schedules; once the cancelled are most of the heap
    # it is rebuilt without them, and what is left (ties, fed items) runs as before.
    ran: list[tuple[float, int]] = []
    loop = EventLoop()

    def record(time: float, n: int) -> Callable[[], None]:
        return lambda: ran.append((time, n))

    loop.feed(((t, (t, -1)) for t in (0.5, 1.5, 2.5)), ran.append)
    handles = [loop.call_at(float(n % 3), record(float(n % 3), n)) for n in range(600)]
    for n, handle in enumerate(handles):
        if n % 10:
            handle.cancel()
            handle.cancel()  # twice is once
    assert len(loop._heap) < 300  # (rebuilt as the cancelled piled up)
    loop.run()
    kept = [n for n in range(600) if n % 10 == 0]
    # By time, and ties in scheduling order (n counts up as they were scheduled).
    assert ran == sorted([(float(n % 3), n) for n in kept] + [(t, -1) for t in (0.5, 1.5, 2.5)])
