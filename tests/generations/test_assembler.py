"""A stream's deltas as log events, without asyncio: the pure half of a streamed run."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_adapters.protocol import TokenDelta
from server.chat_api.chunks import CHAT_WIRE
from server.core.errors import GenerationFailed
from server.generations.assembler import StreamAssembler
from server.generations.log import Event, Kind
from server.generations.shape import Shape
from server.openai_wire.requests import parse_request

TIMINGS = {"queued_ms": 1.0}


def shape(*, chunks: bool = True, interval: int = 1, **body: Any) -> Shape:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    parsed = parse_request({**request, **body}, "chat")
    return Shape(parsed, "m", "abc", True, stream_interval=interval, chunks=chunks, wire=CHAT_WIRE)


def assemble(s: Shape, deltas: list[TokenDelta]) -> list[Event]:
    events: list[Event] = []
    assembler = StreamAssembler(s, 5, events.append)
    assembler.begin()
    for delta in deltas:
        assembler.add(delta)
    assembler.end(TIMINGS, 2)
    return events


def words(*texts: str, index: int = 0) -> list[TokenDelta]:
    """One delta per word, token ids counted from 100; the last one finishes its choice."""
    return [
        TokenDelta(text, [100 + i], "stop" if i == len(texts) - 1 else None, index=index)
        for i, text in enumerate(texts)
    ]


def chunk(event: Event) -> dict[str, Any]:
    assert event.sse.startswith(b"data: ") and event.sse.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(event.sse[len(b"data: ") :])
    return parsed


def test_a_chat_stream_opens_with_the_role_carries_each_delta_and_ends_with_the_summary() -> None:
    events = assemble(shape(), words("a", "b", "c"))
    assert [e.kind for e in events] == [Kind.OPEN, *[Kind.PIECE] * 3, Kind.FINISH]
    assert chunk(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = events[1:4]
    assert [chunk(e)["choices"][0]["delta"]["content"] for e in pieces] == ["a", "b", "c"]
    assert [(e.text, e.tokens, list(e.token_ids)) for e in pieces] == [
        ("a", 1, [100]),
        ("b", 1, [101]),
        ("c", 1, [102]),
    ]
    last = events[-1]
    assert chunk(last)["choices"][0]["finish_reason"] == "stop"
    assert last.final is not None
    assert last.final["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert last.final["timings"] == TIMINGS


def test_a_run_without_chunks_logs_the_same_typed_events_and_no_bytes() -> None:
    def typed(e: Event) -> tuple[Any, ...]:
        return (e.kind, e.index, e.text, e.tokens, list(e.token_ids), e.fields, e.final)

    deltas = words("x", "", "y", "z")  # the empty text rides on the next piece
    rendered = assemble(shape(chunks=True), deltas)
    bare = assemble(shape(chunks=False), deltas)
    assert [typed(e) for e in bare] == [typed(e) for e in rendered]
    assert all(e.sse for e in rendered)
    assert not any(e.sse for e in bare)


def test_with_usage_the_last_choice_finishes_and_a_usage_chunk_follows() -> None:
    events = assemble(shape(stream_options={"include_usage": True}), words("a", "b"))
    assert [e.kind for e in events][-2:] == [Kind.FINISH, Kind.USAGE]
    assert chunk(events[-1])["usage"]["completion_tokens"] == 2
    assert chunk(events[-1])["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_continuous_usage_carries_the_cached_tokens_once_the_engine_has_said() -> None:
    """The role chunk comes before the engine looked the prompt up: its usage has no cached
    tokens; every chunk after the engine's first output has them, and the summary too."""
    said: list[int] = []
    events: list[Event] = []
    s = shape(stream_options={"include_usage": True, "continuous_usage_stats": True})
    assembler = StreamAssembler(s, 5, events.append, lambda: said[0] if said else None)
    assembler.begin()
    said.append(4)  # (the runtime keeps it before the first delta reaches the assembler)
    for delta in words("a", "b"):
        assembler.add(delta)
    assembler.end(TIMINGS, 4)
    usages = [chunk(e)["usage"] for e in events]
    assert "prompt_tokens_details" not in usages[0]
    assert all(u["prompt_tokens_details"] == {"cached_tokens": 4} for u in usages[1:])
    assert events[-2].final is not None
    assert events[-2].final["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_tokens_are_held_to_fill_a_chunk_of_the_stream_interval_but_the_first_and_last() -> None:
    events: list[Event] = []
    assembler = StreamAssembler(shape(interval=3), 5, events.append)
    assembler.begin()
    counts = [assembler.add(d) for d in words(*"abcdefg")]
    assembler.end(TIMINGS, 0)
    # The first token at once; then chunks of three; the last delta ends its choice at once.
    assert counts == [1, 0, 0, 3, 0, 0, 3]
    pieces = [e for e in events if e.kind is Kind.PIECE]
    assert [e.text for e in pieces] == ["a", "bcd", "efg"]
    assert assembler.generated == 7


def test_the_first_choice_to_finish_gets_its_own_finish_and_the_last_one_the_summary() -> None:
    deltas = [
        TokenDelta("a", [1], index=0),
        TokenDelta("b", [2], "length", index=1),
        TokenDelta("c", [3], "stop", index=0),
    ]
    events = assemble(shape(n=2), deltas)
    finishes = [e for e in events if e.kind is Kind.FINISH]
    assert [(e.index, e.final is None) for e in finishes] == [(1, True), (0, False)]
    assert finishes[-1].final is not None
    assert finishes[-1].final["choices"] == [
        {"index": 0, "finish_reason": "stop"},
        {"index": 1, "finish_reason": "length"},
    ]


def test_a_stream_taken_over_continues_its_counts_from_the_events_made_before() -> None:
    s = shape(stream_options={"include_usage": True, "continuous_usage_stats": True})
    before: list[Event] = []
    first = StreamAssembler(s, 5, before.append)
    first.begin()
    for delta in words("a", "b", "c")[:2]:
        first.add(delta)
    after: list[Event] = []
    second = StreamAssembler(s, 5, after.append)
    second.resume(before)
    assert second.generated == 2
    second.add(TokenDelta("c", [102], "stop"))
    assert chunk(after[0])["usage"]["completion_tokens"] == 3
    second.end(TIMINGS, 0)
    assert after[-2].final is not None
    assert after[-2].final["usage"]["completion_tokens"] == 3


def test_deltas_that_end_before_every_choice_finished_fail_the_stream() -> None:
    assembler = StreamAssembler(shape(), 5, [].append)
    assembler.begin()
    assembler.add(TokenDelta("a", [1]))
    with pytest.raises(GenerationFailed):
        assembler.end(TIMINGS, 0)
