"""The event log alone: numbered events, readers from an offset, what a mirror lets them see,
and when the log is concluded. No run, no engine: the log is a leaf."""

from __future__ import annotations

import asyncio

import pytest

from server.core.errors import GenerationFailed
from server.generations.log import Event, EventLog, Kind

pytestmark = pytest.mark.unit


def piece(text: str) -> Event:
    return Event(Kind.PIECE, f"data: {text}\n\n".encode(), text=text, tokens=1)


async def read(log: EventLog, after: int = 0) -> list[tuple[int, str]]:
    return [(seq, event.text) async for seq, event in log.events(after)]


async def test_readers_get_every_event_after_their_offset_live_until_it_closes() -> None:
    log = EventLog(stream=True)
    log.append(piece("a"))
    from_start = asyncio.create_task(read(log))
    from_one = asyncio.create_task(read(log, 1))
    await asyncio.sleep(0)  # both readers have read what is there and wait for more
    log.append(piece("b"))
    log.append(Event(Kind.DONE, b"data: [DONE]\n\n"))
    assert log.concluded and not from_start.done()
    log.close()
    assert await from_start == [(1, "a"), (2, "b"), (3, "")]
    assert await from_one == [(2, "b"), (3, "")]
    assert [event.kind for event in log] == [Kind.PIECE, Kind.PIECE, Kind.DONE]
    assert log[-1].kind is Kind.DONE and len(log) == 3


async def test_readers_see_only_what_is_durable() -> None:
    log = EventLog(stream=True)
    log.durable = 0  # a mirror has written nothing yet
    log.append(piece("a"))
    log.append(piece("b"))
    reader = asyncio.create_task(read(log))
    ending = asyncio.create_task(log.until_closed())
    log.append(Event(Kind.DONE, b"data: [DONE]\n\n"))
    log.close()
    await asyncio.sleep(0)
    assert not reader.done() and not ending.done()
    log.durable = 2  # written: the first two
    log.wake()
    await asyncio.sleep(0)
    assert not ending.done()
    log.durable = None  # the rest is this replica's alone
    log.wake()
    assert (await ending).kind is Kind.DONE
    assert await reader == [(1, "a"), (2, "b"), (3, "")]


def test_an_error_concludes_a_whole_response_but_a_stream_ends_with_done() -> None:
    error = GenerationFailed("no")
    whole, stream = EventLog(stream=False), EventLog(stream=True)
    for log in (whole, stream):
        log.append(Event(Kind.FAILED, error=error))
    assert whole.concluded and not stream.concluded
    stream.append(Event(Kind.DONE, b"data: [DONE]\n\n"))
    assert stream.concluded
    assert stream.size > whole.size > 0


async def test_dispatch_wakes_the_waiters() -> None:
    log = EventLog(stream=True)
    changed = asyncio.create_task(log.changed())
    await asyncio.sleep(0)
    log.mark_dispatched()
    await changed
    assert log.dispatched
