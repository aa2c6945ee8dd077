"""The asyncio shell with the real `sim` engine, in virtual time: the loop's clock jumps to the
next timer whenever nothing can run (looptime), so an engine step costs no wall time and every
time here is exact. The runtime and the tickets read that clock too."""

from __future__ import annotations

import asyncio

import pytest

from engine_adapters.protocol import GenerationRequest, SamplingOptions
from engine_adapters.sim import SimConfig, SimEngine
from server.core.config import SluiceConfig, parse_config
from server.core.errors import DeadlineExceeded, Overloaded
from server.observability.metrics import Metrics
from server.scheduler.runtime import SchedulerRuntime
from server.scheduler.types import Ticket, TrafficClass

pytestmark = pytest.mark.looptime

# Priors only (no start-up calibration), so optimistic that admission never predicts a miss:
# the deadline itself decides.
OPTIMISTIC = {
    "estimates": {"decode_tokens_per_s": 1e9, "prefill_tokens_per_s": 1e9, "calibrate": False}
}


def make_ticket(
    request_id: str,
    *,
    deadline_s: float = 30.0,
    max_tokens: int = 8,
    traffic_class: TrafficClass = TrafficClass.INTERACTIVE,
) -> Ticket:
    now = asyncio.get_running_loop().time()
    return Ticket(request_id, "default", traffic_class, "sim", now, now + deadline_s, 4, max_tokens)


def make_request(ticket: Ticket) -> GenerationRequest:
    return GenerationRequest(
        ticket.request_id,
        [7] * ticket.prompt_tokens,
        SamplingOptions(max_tokens=ticket.max_tokens, ignore_eos=True),
    )


async def started_runtime(config: SluiceConfig, sim: SimConfig | None = None):
    engine = SimEngine(sim or SimConfig())
    await engine.start()
    runtime = SchedulerRuntime(
        config, engine, "sim", Metrics(), clock=asyncio.get_running_loop().time
    )
    await runtime.start()
    return engine, runtime


async def collect(
    runtime: SchedulerRuntime, ticket: Ticket, dispatched: asyncio.Event | None = None
) -> list[int]:
    tokens: list[int] = []
    async with runtime.generation(ticket, make_request(ticket)) as gen:
        assert gen.dispatched_at >= ticket.arrival
        if dispatched is not None:
            dispatched.set()
        async for delta in gen:
            tokens.extend(delta.token_ids)
    return tokens


async def test_requests_stream_to_the_end_and_release_every_budget() -> None:
    engine, runtime = await started_runtime(parse_config({"budgets": {"max_running_seqs": 2}}))
    try:
        results = await asyncio.gather(*(collect(runtime, make_ticket(f"r{i}")) for i in range(6)))
        assert [len(r) for r in results] == [8] * 6
        assert runtime.core.is_idle()
        assert engine.num_unfinished_requests() == 0
    finally:
        await engine.stop()


async def test_only_what_may_be_preempted_keeps_its_tokens_to_resume_from() -> None:
    # A chat is never preempted: the runtime holds none of its tokens, however long it runs.
    # Preemptible bulk holds every one, for the continuation's prompt.
    engine, runtime = await started_runtime(parse_config({}))
    try:
        kept = {}
        for traffic_class in TrafficClass:
            ticket = make_ticket(traffic_class.value, max_tokens=64, traffic_class=traffic_class)
            async with runtime.generation(ticket, make_request(ticket)) as gen:
                tokens = [t async for delta in gen for t in delta.token_ids]
                kept[traffic_class] = (len(tokens), gen.tokens_kept)
        assert kept == {TrafficClass.INTERACTIVE: (64, 0), TrafficClass.BULK: (64, 64)}
    finally:
        await engine.stop()


async def test_full_queue_is_refused_at_once_with_overloaded() -> None:
    config = parse_config(
        {"budgets": {"max_running_seqs": 1}, "classes": {"interactive": {"max_queued": 1}}}
    )
    engine, runtime = await started_runtime(config)
    try:
        first = asyncio.create_task(collect(runtime, make_ticket("a", max_tokens=64)))
        second = asyncio.create_task(collect(runtime, make_ticket("b")))
        await asyncio.sleep(0)  # let both submit
        refused = make_ticket("c")
        with pytest.raises(Overloaded) as refusal:  # decided by the call itself, no await
            runtime.generation(refused, make_request(refused))
        assert refusal.value.retry_after is not None
        await asyncio.gather(first, second)
        assert runtime.core.is_idle()
    finally:
        await engine.stop()


async def test_cancelled_waiter_leaves_the_queue_without_touching_the_engine() -> None:
    engine, runtime = await started_runtime(parse_config({"budgets": {"max_running_seqs": 1}}))
    try:
        first = asyncio.create_task(collect(runtime, make_ticket("a", max_tokens=64)))
        waiting = asyncio.create_task(collect(runtime, make_ticket("b")))
        await asyncio.sleep(0)
        assert runtime.core.stage("b") == "queued"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert runtime.core.stage("b") is None
        assert engine.num_unfinished_requests() <= 1
        await first
        assert runtime.core.is_idle()
    finally:
        await engine.stop()


async def test_running_deadline_aborts_the_engine_request() -> None:
    slow = SimConfig(step_base_ms=20.0)
    engine, runtime = await started_runtime(parse_config(OPTIMISTIC), slow)
    try:
        ticket = make_ticket("slow", deadline_s=0.1, max_tokens=1000)
        with pytest.raises(DeadlineExceeded):
            await collect(runtime, ticket)
        assert asyncio.get_running_loop().time() == pytest.approx(ticket.deadline)  # mid-step
        assert engine.num_unfinished_requests() == 0
        assert runtime.core.is_idle()
    finally:
        await engine.stop()


async def test_queued_deadline_expires_at_the_deadline() -> None:
    slow = SimConfig(step_base_ms=20.0)
    engine, runtime = await started_runtime(
        parse_config({**OPTIMISTIC, "budgets": {"max_running_seqs": 1}}), slow
    )
    try:
        blocker = asyncio.create_task(collect(runtime, make_ticket("a", max_tokens=30)))
        await asyncio.sleep(0)
        # Admission predicts with the optimistic prior, so this deadline looks meetable.
        queued = make_ticket("b", deadline_s=0.2)
        with pytest.raises(DeadlineExceeded):
            await collect(runtime, queued)
        assert asyncio.get_running_loop().time() == pytest.approx(queued.deadline)
        assert not blocker.done()  # 30 steps of 20 ms
        await blocker
        assert runtime.core.is_idle()
    finally:
        await engine.stop()


async def test_state_gauges_follow_the_scheduler() -> None:
    engine, runtime = await started_runtime(parse_config({"budgets": {"max_running_seqs": 1}}))

    def gauge(name: str, **labels: str) -> float | None:
        return runtime.metrics.registry.get_sample_value(name, labels)

    try:
        first = asyncio.create_task(collect(runtime, make_ticket("g1", max_tokens=32)))
        queued = asyncio.create_task(collect(runtime, make_ticket("g2")))
        await asyncio.sleep(0)
        labels = {"model": "sim", "traffic_class": "interactive"}
        assert gauge("sluice_queue_depth", **labels) == 1
        assert gauge("sluice_running_requests", **labels) == 1
        assert gauge("sluice_budget_in_use", budget="sequences") == 1
        assert gauge("sluice_budget_limit", budget="sequences") == 1
        kv_limit = runtime.core.ledger.limits.kv_blocks
        assert gauge("sluice_budget_limit", budget="kv_blocks") == kv_limit
        await asyncio.gather(first, queued)
        assert gauge("sluice_queue_depth", **labels) == 0
        assert gauge("sluice_running_requests", **labels) == 0
        for budget in ("tokens", "kv_blocks", "sequences"):
            assert gauge("sluice_budget_in_use", budget=budget) == 0
    finally:
        await engine.stop()


async def test_preempted_bulk_stream_resumes_and_delivers_every_token() -> None:
    config = parse_config(
        {
            **OPTIMISTIC,
            "budgets": {
                "max_running_seqs": 2,
                "interactive_reserve_share": 0.0,
                "bulk_min_share": 0.0,
                "preempt_bulk_after_ms": 50,
            },
        }
    )
    engine, runtime = await started_runtime(config)
    try:
        bulk = [
            make_ticket(f"bulk{i}", max_tokens=400, traffic_class=TrafficClass.BULK)
            for i in range(2)
        ]
        running = [asyncio.Event() for _ in bulk]
        streams = [
            asyncio.create_task(collect(runtime, t, e)) for t, e in zip(bulk, running, strict=True)
        ]
        for event in running:
            await event.wait()
        chat = make_ticket("chat", max_tokens=8)
        async with runtime.generation(chat, make_request(chat)) as generation:
            # It waited its preemption delay, then took a preempted stream's seat.
            assert generation.dispatched_at - chat.arrival == pytest.approx(0.050)
            chat_tokens = [token async for delta in generation for token in delta.token_ids]
        assert len(chat_tokens) == 8
        assert runtime.core.preemptions_total == 1
        stopped = runtime.metrics.registry.get_sample_value(
            "sluice_bulk_preemptions_total", {"model": "sim", "cause": "waiting_chat"}
        )
        assert stopped == 1
        assert not any(s.done() for s in streams)  # the chat did not wait for bulk to end
        assert [len(tokens) for tokens in await asyncio.gather(*streams)] == [400, 400]
        assert runtime.core.is_idle()
        assert engine.num_unfinished_requests() == 0
    finally:
        await engine.stop()


async def test_a_resumed_request_computes_again_only_what_follows_its_cached_blocks() -> None:
    def resumed_prefill() -> float:
        value = runtime.metrics.registry.get_sample_value(
            "sluice_resumed_prefill_tokens_total", {"model": "sim"}
        )
        return value or 0.0

    config = parse_config(
        {
            **OPTIMISTIC,
            "budgets": {
                "max_running_seqs": 1,
                "interactive_reserve_share": 0.0,
                "bulk_min_share": 0.0,
                "preempt_bulk_after_ms": 1,
            },
        }
    )
    engine, runtime = await started_runtime(config, SimConfig(block_size=16))
    try:
        bulk = make_ticket("bulk", max_tokens=400, traffic_class=TrafficClass.BULK)
        past_two_blocks = asyncio.Event()
        hits: list[int | None] = []

        async def stream_bulk() -> int:
            count = 0
            async with runtime.generation(bulk, make_request(bulk)) as generation:
                async for delta in generation:
                    count += len(delta.token_ids)
                    if count >= 40:
                        past_two_blocks.set()
                hits.append(generation.cached_tokens)
            return count

        streaming = asyncio.create_task(stream_bulk())
        await past_two_blocks.wait()
        assert len(await collect(runtime, make_ticket("chat", max_tokens=4))) == 4
        assert runtime.core.preemptions_total == 1
        assert await streaming == 400
        # It had 4 prompt and 40+ generated tokens: without the cache it would compute them
        # all again; with it, only the block that holds its last token.
        assert 0 < resumed_prefill() <= 16
        # What its usage reports is its first engine request's hit (its 4-token prompt, no
        # whole block), not its continuation's.
        assert hits == [0]
    finally:
        await engine.stop()


async def test_the_sequences_budget_is_the_engine_seats() -> None:
    # Sluice's own limit (256 by default) is above the engine's: the engine's seats bound it.
    engine, runtime = await started_runtime(parse_config(OPTIMISTIC), SimConfig(max_num_seqs=12))
    try:
        assert runtime.core.ledger.limits.sequences == 12
        gauge = runtime.metrics.registry.get_sample_value
        assert gauge("sluice_budget_limit", {"budget": "sequences"}) == 12
    finally:
        await engine.stop()


async def test_each_lora_adapter_is_calibrated_at_start_and_when_loaded() -> None:
    # Steps that run an adapter cost twice the base model's: each adapter's chats are judged
    # by twice the base model's gap target, exported under its own model label.
    config = parse_config({"estimates": {"calibrate": True}})
    sim = SimConfig(max_loras=2, lora_step_factor=2.0)
    engine = SimEngine(sim, adapters={"early": "early"})
    await engine.start()
    metrics = Metrics()
    runtime = SchedulerRuntime(
        config, engine, "sim", metrics, clock=asyncio.get_running_loop().time
    )
    try:
        await runtime.start()
        estimates, cap = runtime.core.estimates, runtime.core.bulk_cap
        early = estimates.adapter_cost("early")
        assert (early.step, early.ttft) == (pytest.approx(2.0), pytest.approx(2.0))

        def itl_target(model: str) -> float | None:
            return metrics.registry.get_sample_value(
                "sluice_slo_target_seconds",
                {"model": model, "traffic_class": "interactive", "target": "itl"},
            )

        assert itl_target("early") == pytest.approx(2 * cap.targets(None).itl_s)
        assert itl_target("sim") == pytest.approx(cap.targets(None).itl_s)
        await engine.load_adapter("late", "late")
        runtime.adapter_loaded("late")
        assert itl_target("late") == pytest.approx(cap.targets(None).itl_s)  # not timed yet
        await asyncio.gather(*runtime.adapter_calibrations)
        late = estimates.adapter_cost("late")
        assert (late.step, late.ttft) == (pytest.approx(2.0), pytest.approx(2.0))
        assert itl_target("late") == pytest.approx(2 * cap.targets(None).itl_s)
    finally:
        await runtime.stop()
        await engine.stop()
