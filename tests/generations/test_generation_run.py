"""In process: one generation's run and its log, the store that finds it again, the chunk
encoder, the request parser and the send guard. The engine is the real `sim` engine behind
the real scheduler runtime; no server, no sockets. In virtual time: the loop's clock jumps to
the next timer whenever nothing can run (looptime), so engine steps cost no wall time; the
runtime, the tenants, the run store and the timelines' arrivals read that clock too.
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.utils import floatToGoString

from engine_adapters.sim import SimConfig, SimEngine
from server.api.app import build_app
from server.api.serving import build_stores
from server.chat_api.chunks import ChunkEncoder
from server.core.config import parse_config
from server.core.errors import GenerationCancelled, IdempotencyKeyReused, InvalidRequest
from server.generations.planner import RequestContext
from server.generations.reading import reader, sse
from server.generations.registry import RunStore
from server.generations.run import Event, GenerationRun, Kind
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.http.send_guard import SendGuard
from server.observability.metrics import Metrics
from server.openai_wire.requests import parse_request
from server.scheduler.attainment import ChatMeter
from server.scheduler.runtime import SchedulerRuntime
from server.scheduler.slo import SloTargets

OPTIMISTIC = {
    "estimates": {"decode_tokens_per_s": 1e9, "prefill_tokens_per_s": 1e9, "calibrate": False}
}
pytestmark = pytest.mark.looptime

REQUEST_NUMBERS = itertools.count()
BODY = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 12,
    "seed": 3,
    "stream": True,
}


@pytest.fixture
async def sluice():  # type: ignore[no-untyped-def]  # the app's Generations
    # Set up on the loop's wall time (looptime compacts the test's only): nothing here waits.
    clock = asyncio.get_running_loop().time
    engine = SimEngine(SimConfig(step_base_ms=2.0))
    config = parse_config(OPTIMISTIC)
    metrics = Metrics()
    runtime = SchedulerRuntime(config, engine, "sim", metrics, clock=clock)
    stores = build_stores(engine, config, metrics)
    app = build_app(engine, runtime, config, "sim", metrics=metrics, stores=stores, clock=clock)
    await engine.start()
    await runtime.start()
    yield app.services.generations
    await runtime.stop()
    await engine.stop()


async def open_run(
    sluice: Generations, body: dict = BODY, key: str | None = None
) -> tuple[GenerationRun, bool]:
    timeline = RequestTimeline(
        request_id=f"r{next(REQUEST_NUMBERS)}",
        model="sim",
        api="chat",
        arrival=asyncio.get_running_loop().time(),  # the ticket's, on the scheduler's clock
        metrics=sluice.metrics,
    )
    return await sluice.generate(
        parse_request(body, "chat"),
        body,
        timeline,
        RequestContext(),
        key,
        stream=bool(body.get("stream")),
    )


async def read_all(run: GenerationRun, after: int = 0) -> list[tuple[int, Kind]]:
    with run.reading():
        return [(seq, event.kind) async for seq, event in run.events(after)]


@pytest.mark.parametrize("key", [None, "k"])
async def test_a_stream_logs_numbered_events_and_ends_once(
    sluice: Generations, key: str | None
) -> None:
    run, replayed = await open_run(sluice, key=key)
    with run.reading():
        events = [(seq, event) async for seq, event in run.events()]
    assert not replayed and run.ended and run.timeline.ended
    assert [seq for seq, _ in events] == list(range(1, len(events) + 1))
    kinds = [event.kind for _, event in events]
    assert kinds[0] is Kind.OPEN and kinds[-2] is Kind.FINISH and kinds[-1] is Kind.DONE
    pieces = [e for _, e in events if e.kind is Kind.PIECE]
    assert sum(e.tokens for e in pieces) == run.timeline.generated_tokens == 12
    assert len(run.log) == len(events)
    if key is None:
        # Nobody can come back for it: its log held only what its one reader had not taken.
        assert run.log.held == 1
    else:
        # A second reader from any offset reads the same events after it.
        assert await read_all(run, 3) == [(seq, event.kind) for seq, event in events[3:]]
    assert sluice.dispatcher.core.is_idle()  # type: ignore[attr-defined]


def sse_events(sse: bytes) -> list[tuple[int | None, dict]]:
    """(id, chunk) for each `data: {...}` event of SSE bytes."""
    found = []
    for event in sse.split(b"\n\n"):
        fields = dict(line.split(b": ", 1) for line in event.split(b"\n") if b": " in line)
        if fields.get(b"data", b"").startswith(b"{"):
            seq = fields.get(b"id")
            found.append((None if seq is None else int(seq), json.loads(fields[b"data"])))
    return found


def content_of(chunks: list[dict]) -> list[str]:
    return [
        c["choices"][0]["delta"]["content"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


async def test_an_idle_stream_sends_one_token_per_event(sluice: Generations) -> None:
    # The reader keeps up (an engine step takes time, the reader none): it takes each piece
    # alone and writes it as an event of its own, one token each, so that TTFT and the gaps
    # between events keep their meaning. Its log holds nothing it has taken but the last.
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 30, "ignore_eos": True})
    pieces = 0
    with run.reading():
        async for last, batch in run.log.batches():
            assert run.log.held == 1  # (no run that nobody can resume keeps what was read)
            sent = sse_events(sse(run, last, batch, merge=True))
            assert len(sent) == sum(e.kind is not Kind.DONE for e in batch)
            in_batch = [e for e in batch if e.kind is Kind.PIECE]
            assert len(in_batch) <= 1 and all(e.tokens == 1 for e in in_batch)
            pieces += len(in_batch)
    assert pieces == 30 == run.timeline.generated_tokens


async def test_a_run_read_by_one_reader_writes_each_token_in_its_own_task(
    sluice: Generations,
) -> None:
    # A stream nobody can resume, read by its one reader: the run writes what it logs in its
    # own task (no task woken per token), one token per event while the client keeps up,
    # and its log holds nothing it has written.
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 30, "ignore_eos": True})
    assert run.writable
    writes: list[tuple[asyncio.Task[object] | None, bytes, int]] = []
    finals: list[bool] = []

    async def write(last: int, batch: list[Event], final: bool) -> None:
        writes.append((asyncio.current_task(), sse(run, last, batch, merge=True), run.log.held))
        finals.append(final)

    with run.reading():
        await run.written(write)
    reader = asyncio.current_task()
    texts = [content_of([c for _, c in sse_events(chunk)]) for _, chunk, _ in writes]
    assert all(len(text) <= 1 for text in texts)  # one piece of text a write
    assert sum(len(text) for text in texts) == 30 == run.timeline.generated_tokens
    by_run = [task for task, _, _ in writes if task is not reader]
    assert len(by_run) >= 30  # every token's write (the role's and the end's are the reader's)
    assert all(held <= 1 for _, _, held in writes)
    assert writes[-1][1].endswith(b"data: [DONE]\n\n") and run.ended
    assert finals == [False] * (len(writes) - 1) + [True]  # the last ends the response with it


async def test_a_slow_client_holds_its_run_and_the_engine_keeps_the_backlog(
    sluice: Generations,
) -> None:
    # The client takes five engine steps to accept each write: the run waits in its write,
    # and the engine's next delta brings every token made meanwhile: fewer, larger chunks,
    # every token counted, and nothing piling up in the log.
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 30, "ignore_eos": True})
    texts: list[str] = []
    held: list[int] = []

    async def write(last: int, batch: list[Event], final: bool) -> None:
        texts.extend(content_of([c for _, c in sse_events(sse(run, last, batch, merge=True))]))
        held.append(run.log.held)
        await asyncio.sleep(0.010)  # the client's socket accepts the bytes 10 ms later

    with run.reading():
        await run.written(write)
    assert run.timeline.generated_tokens == 30
    assert 1 < len(texts) < 30  # several tokens a chunk
    assert max(held) <= 2


@pytest.mark.parametrize("key", [None, "behind"])
async def test_a_reader_that_fell_behind_gets_the_waiting_text_as_one_chunk(
    sluice: Generations, key: str | None
) -> None:
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 30, "ignore_eos": True}, key=key)
    with run.reading():
        await run.until_ended()  # the reader took nothing while the run went on
        assert run.log.held == len(run.log)  # what it has not taken is all there
        ((last, batch),) = [taken async for taken in run.log.batches()]
    merged = sse_events(sse(run, last, batch, merge=True))
    one_each = sse_events(sse(run, last, batch, merge=False))
    assert len(content_of([c for _, c in one_each])) == 30
    (text,) = content_of([c for _, c in merged])
    assert text == "".join(content_of([c for _, c in one_each]))
    if key is not None:  # resumable: the merged chunk is numbered as the last piece it holds
        pieces = [n for n, e in enumerate(batch, 1) if e.kind is Kind.PIECE]
        assert [seq for seq, c in merged if content_of([c])] == [pieces[-1]]
        assert [seq for seq, _ in one_each][:3] == [1, 2, 3]


async def test_stream_interval_fills_every_chunk_but_a_choices_first_and_last(
    sluice: Generations,
) -> None:
    body = {**BODY, "max_tokens": 14, "ignore_eos": True, "stream_interval": 4}
    run, _ = await open_run(sluice, body)
    with run.reading():
        pieces = [e for _, e in [x async for x in run.events()] if e.kind is Kind.PIECE]
    # (one token per engine step: the first at once, then four at a time, the rest at the end)
    assert [e.tokens for e in pieces] == [1, 4, 4, 4, 1]
    assert run.timeline.generated_tokens == 14


def test_per_token_metrics_are_flushed_as_one_by_one_observations_would_be() -> None:
    now = [0.0]
    metrics = Metrics()
    timeline = RequestTimeline("r", "m", "chat", metrics, arrival=0.0, clock=lambda: now[0])
    # prometheus_client's own histogram, one `observe` a token, with the same buckets.
    bounds = metrics.inter_token_latency.bounds
    reference_registry = CollectorRegistry()
    reference = Histogram("reference", "", buckets=bounds, registry=reference_registry)
    labels = {"model": "m", "traffic_class": "interactive"}

    def sample(name: str, **extra: str) -> float | None:
        return metrics.registry.get_sample_value(name, {**labels, **extra})

    previous = None
    for at, count in [(0.1, 1), (0.15, 1), (0.45, 3), (0.4501, 1), (1.2, 2), (1.25, 1), (4, 5)]:
        now[0] = at
        timeline.wrote_tokens(count)
        if previous is not None:
            for _ in range(count):
                reference.observe((at - previous) / count)
        previous = at
        if at == 1.2:  # a second since the first token: what came so far is in the registry
            assert sample("sluice_generated_tokens_total") == 8
        if at == 1.25:  # (and the next writes wait for the next flush)
            assert sample("sluice_generated_tokens_total") == 8
    timeline.finish("completed")
    assert sample("sluice_generated_tokens_total") == 14
    assert sample("sluice_time_to_first_token_seconds_count") == 1
    for le in map(floatToGoString, bounds):
        expected = reference_registry.get_sample_value("reference_bucket", {"le": le})
        assert sample("sluice_inter_token_latency_seconds_bucket", le=le) == expected, le
    assert sample("sluice_inter_token_latency_seconds_count") == 13
    assert sample("sluice_inter_token_latency_seconds_sum") == pytest.approx(
        reference_registry.get_sample_value("reference_sum")
    )


@pytest.mark.parametrize("chunk_tokens", [1, 2])
def test_the_gap_targets_judge_each_chunks_wait_as_its_reader_waits_it(chunk_tokens: int) -> None:
    """A token whose text waited for the next (a piece of a character) reaches the reader with
    it, two steps after the last: the SLO's gap is that chunk's whole wait, over the tokens a
    chunk is meant to hold (the stream interval); the inter-token histogram keeps its tokens."""
    now = [0.0]
    meter = ChatMeter()
    timeline = RequestTimeline("r", "m", "chat", Metrics(), arrival=0.0, clock=lambda: now[0])
    timeline.slo, timeline.meter = SloTargets(ttft_s=1.0, itl_s=0.01), meter
    timeline.chunk_tokens = chunk_tokens
    for at, count in [(0.0, 1), (0.01, 1), (0.03, 2), (0.04, 1)]:
        now[0] = at
        timeline.wrote_tokens(count)
    assert timeline.itl == pytest.approx([0.01] * 4)
    assert timeline.gaps == pytest.approx([0.01, 0.02 / chunk_tokens, 0.01])
    timeline.finish("completed")
    (ended,) = meter.take_ended()
    assert ended.median_gap_share == pytest.approx(1.0)


async def test_cancelled_before_its_task_began_it_still_ends_once(sluice: Generations) -> None:
    run, _ = await open_run(sluice)
    run.cancel(GenerationCancelled("at once"))  # before the task has had a turn
    last = await run.until_ended()
    assert last.kind is Kind.DONE and run.log[-2].kind is Kind.FAILED
    assert isinstance(run.log[-2].error, GenerationCancelled)
    assert run.log[-2].error.__traceback__ is None  # no cycle through the producer's frame
    assert run.timeline.ended and not run.dispatched
    assert sluice.dispatcher.core.is_idle()  # type: ignore[attr-defined]


async def test_the_last_reader_leaving_cancels_only_what_cannot_resume(sluice: Generations) -> None:
    body = {**BODY, "max_tokens": 500}
    plain, _ = await open_run(sluice, body)
    resumable, _ = await open_run(sluice, body, key="k")
    for run in (plain, resumable):
        with run.reading():
            await run.started()
    left = asyncio.get_running_loop().time()
    await plain.until_ended()
    assert asyncio.get_running_loop().time() == left  # at once, not after an engine step
    assert isinstance(plain.log[-2].error, GenerationCancelled)
    assert not resumable.ended  # it runs on, for the grace period, with no reader
    finished = await resumable.until_ended()
    assert finished.kind is Kind.DONE
    assert not any(event.kind is Kind.FAILED for event in resumable.log)


async def test_a_reader_is_handed_the_error_that_ended_the_run_before_dispatch(
    sluice: Generations,
) -> None:
    run, _ = await open_run(sluice)
    run.cancel(GenerationCancelled("at once"))  # before it reached the engine
    async with reader(run) as failure:
        assert isinstance(failure, GenerationCancelled) and run.ended and not run.dispatched


async def test_a_reader_begins_at_dispatch_or_at_the_end_and_its_leaving_cancels(
    sluice: Generations,
) -> None:
    whole, _ = await open_run(sluice, {**BODY, "stream": False})
    async with reader(whole, "ended") as failure:
        assert failure is None and whole.ended and whole.log[-1].kind is Kind.WHOLE
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 500})
    async with reader(run) as failure:
        assert failure is None and run.dispatched and not run.ended
    last = await run.until_ended()  # its one reader left: cancelled
    assert last.kind is Kind.DONE and isinstance(run.log[-2].error, GenerationCancelled)


async def test_the_same_key_attaches_and_another_body_is_refused(sluice: Generations) -> None:
    first, replayed_first = await open_run(sluice, key="same")
    second, replayed_second = await open_run(sluice, key="same")
    assert second is first and (replayed_first, replayed_second) == (False, True)
    with pytest.raises(IdempotencyKeyReused):
        await open_run(sluice, {**BODY, "max_tokens": 3}, key="same")
    with pytest.raises(InvalidRequest):
        await open_run(sluice, key="x" * 256)
    await read_all(first)


def test_a_sweep_reads_only_the_ended_runs_it_drops() -> None:
    now = [0.0]
    store = RunStore(retention_seconds=50, max_bytes=10**9, clock=lambda: now[0])
    reads = [0]

    class Ended:  # a stand-in run whose size counts its reads
        def __init__(self, public_id: str) -> None:
            self.shape = type("Shape", (), {"public_id": public_id})()
            self.dispatched = True

        @property
        def size(self) -> int:
            reads[0] += 1
            return 100

    for i in range(100):
        now[0] = i / 2  # the last ends at 49.5 s: none past its retention yet
        run = Ended(f"chatcmpl-{i}")
        store.add("acme", None, "print", run)  # type: ignore[arg-type]
        store.ended(run)  # type: ignore[arg-type]
    now[0], reads[0] = 60.5, 0
    store.sweep()
    # Runs 0-20 ended more than 50 s ago: those are dropped, and none of the others is read.
    assert reads[0] <= 21
    assert len(store) == 79 and store.by_id("acme", "chatcmpl-20") is None


def test_the_store_keeps_ended_runs_within_its_bound() -> None:
    now = [0.0]
    store = RunStore(retention_seconds=10, max_bytes=1000, clock=lambda: now[0])

    class Ended:  # what the store reads of a run (a stand-in: no engine needed here)
        def __init__(self, public_id: str, size: int) -> None:
            self.shape = type("Shape", (), {"public_id": public_id})()
            self.size, self.dispatched = size, True

    runs = [Ended(f"chatcmpl-{i}", 400) for i in range(3)]
    for i, run in enumerate(runs):
        store.add("acme", f"k{i}", "print", run)  # type: ignore[arg-type]
        store.ended(run)  # type: ignore[arg-type]
    # 1,200 bytes over a 1,000 bound: the oldest went first.
    assert store.by_id("acme", "chatcmpl-0") is None
    assert store.by_key("acme", "k2") == (runs[2], "print")
    assert store.by_id("globex", "chatcmpl-2") is None  # another tenant's is not found
    now[0] = 11.0
    assert store.by_id("acme", "chatcmpl-2") is None and len(store) <= 1  # past retention


def test_chunks_render_as_openai_objects_on_both_paths() -> None:
    encoder = ChunkEncoder("chat", "abc", "m", include_usage=True)
    fast = json.loads(encoder.text("hé", 1)[len(b"data: ") :])
    assert fast["id"] == "chatcmpl-abc" and fast["choices"][0]["delta"] == {"content": "hé"}
    assert fast["usage"] is None
    full = json.loads(
        ChunkEncoder("chat", "abc", "m", True, continuous_usage=True, prompt_tokens=2).text(
            "hé", 1
        )[len(b"data: ") :]
    )
    assert full["choices"][0]["delta"] == {"content": "hé"}
    assert full["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    finish = json.loads(encoder.finish("stop", None, None, 1)[len(b"data: ") :])
    assert finish["choices"][0]["finish_reason"] == "stop"


def test_the_request_parser_names_the_bad_field() -> None:
    parsed = parse_request({**BODY, "temperature": 0.5}, "chat")
    assert parsed.stream and parsed.max_tokens == 12 and parsed.sampling["temperature"] == 0.5
    for bad, param in (
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"return_hidden_states": True}, "return_hidden_states"),
    ):
        with pytest.raises(InvalidRequest) as raised:
            parse_request({**BODY, **bad}, "chat")
        assert raised.value.param == param


async def test_the_send_guard_cancels_a_send_stuck_past_its_timeout() -> None:
    guard = SendGuard(timeout=5.0)
    stuck = asyncio.Event()

    async def never_accepted(message: object) -> None:
        stuck.set()
        await asyncio.Event().wait()

    send = guard.wrap(never_accepted)
    task = asyncio.create_task(send({"type": "http.response.body"}))
    await stuck.wait()
    loop = asyncio.get_running_loop()
    assert guard.check(loop.time() + 1.0) == 0  # within the timeout
    assert guard.check(loop.time() + 6.0) == 1
    with pytest.raises(asyncio.CancelledError):
        await task


class _SharedState:
    """Shared runs whose 'does a replica following this run have a reader?' gets `answers` in
    turn (None: the state did not answer in time), and that records when it was asked."""

    up = True

    def __init__(self, answers: list[bool | None]) -> None:
        self.answers = answers
        self.asked: list[float] = []

    async def open(self, record: object, key: str, fingerprint: str) -> None:
        return None  # made here

    async def forget(self, record: object) -> None:
        raise AssertionError("nothing here is refused")

    def mirror(self, record: object) -> _SharedState:
        return self

    def start(self, log: object, cancel: object) -> None:
        pass  # (its log needs no writing: its readers see all of it)

    async def read_elsewhere(self) -> bool | None:
        self.asked.append(asyncio.get_running_loop().time())
        return self.answers.pop(0)


async def test_an_unanswered_question_of_readers_elsewhere_cancels_nothing(
    sluice: Generations,
) -> None:
    shared = _SharedState([None, None, False])
    sluice.shared = shared
    run, _ = await open_run(sluice, {**BODY, "max_tokens": 500}, key="k")
    grace = run.grace_seconds = 0.1  # (500 tokens take a second of the sim engine)
    with run.reading():
        await run.started()
    left = asyncio.get_running_loop().time()
    await run.until_ended()
    # Twice unanswered, the question is asked again a grace period later; "no" cancels.
    assert shared.asked == pytest.approx([left + grace, left + 2 * grace, left + 3 * grace])
    assert isinstance(run.log[-2].error, GenerationCancelled)
