from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from collections.abc import AsyncIterator

import pytest

from engine_adapters.protocol import (
    EngineClient,
    EngineDeadError,
    EngineRequestError,
    GenerationRequest,
    KVCacheInfo,
    SamplingOptions,
    TokenDelta,
)
from engine_adapters.sim import SimEngine
from engine_adapters.sim_model import (
    SPECIAL_TOKENS,
    WORDS,
    SimConfig,
    SimTimingModel,
    StepResult,
    add_sim_arguments,
    detokenize,
    stable_hash,
)

# Round numbers so durations can be checked exactly: base 1 ms, decode 0.1, prefill 0.01.
EXACT = SimConfig(step_base_ms=1.0, decode_ms_per_token=0.1, prefill_ms_per_token=0.01)
PROMPT = list(range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + 8))

# The engine client's tests run in virtual time: the loop's clock jumps to the next timer
# whenever nothing can run (looptime), so a step costs no wall time and lasts exactly what the
# model says.
pytestmark = pytest.mark.looptime


def run_to_completion(model: SimTimingModel, max_steps: int = 10_000) -> list[StepResult]:
    results = []
    while model.has_work:
        results.append(model.step())
        assert len(results) < max_steps, "the model made no progress"
    return results


def tokens_by_request(results: list[StepResult]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for result in results:
        for out in result.outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def finish_reasons(results: list[StepResult]) -> dict[str, str]:
    return {
        out.request_id: out.finish_reason
        for result in results
        for out in result.outputs
        if out.finish_reason is not None
    }


# --------------------------------------------------------------------------- timing model


def test_step_time_grows_with_decode_tokens_in_the_step() -> None:
    for batch in (1, 8, 32):
        model = SimTimingModel(EXACT)
        for i in range(batch):
            model.add(f"r{i}", PROMPT, max_tokens=4)
        prefill = model.step()
        assert prefill.prefill_tokens == 8 * batch and prefill.decode_tokens == 0
        assert prefill.duration_s == pytest.approx((1.0 + 0.01 * 8 * batch) / 1000)
        decode = model.step()
        assert decode.decode_tokens == batch and decode.prefill_tokens == 0
        assert decode.duration_s == pytest.approx((1.0 + 0.1 * batch) / 1000)


def test_default_step_of_32_sequences_takes_about_5_ms() -> None:
    model = SimTimingModel()
    for i in range(32):
        model.add(f"r{i}", PROMPT, max_tokens=4)
    model.step()
    assert model.step().duration_s == pytest.approx(0.005)


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    model = SimTimingModel(
        SimConfig(
            step_base_ms=1.0,
            decode_ms_per_token=0.1,
            prefill_ms_per_token=0.01,
            max_num_seqs=4,
            max_batched_tokens=64,
        )
    )
    model.add("long", [7] * 150, max_tokens=2)
    steps = [model.step() for _ in range(3)]
    assert [s.prefill_tokens for s in steps] == [64, 64, 22]
    assert [s.duration_s * 1000 for s in steps] == pytest.approx([1.64, 1.64, 1.22])
    assert [len(s.outputs) for s in steps] == [0, 0, 1]  # first token when the prompt is done
    assert model.step().decode_tokens == 1


def test_decodes_and_a_prefill_chunk_share_the_step_budget() -> None:
    model = SimTimingModel(
        SimConfig(step_base_ms=1.0, max_num_seqs=4, max_batched_tokens=16, kv_blocks=512)
    )
    model.add("a", PROMPT, max_tokens=10)
    model.add("b", PROMPT, max_tokens=10)
    model.step()  # both prompts (16 tokens)
    model.add("long", [7] * 40, max_tokens=1)
    step = model.step()
    assert (step.decode_tokens, step.prefill_tokens) == (2, 14)


def test_kv_exhaustion_preempts_the_newest_and_everything_still_completes() -> None:
    tight = SimConfig(block_size=4, kv_blocks=8, max_model_len=32, max_batched_tokens=256)
    model = SimTimingModel(tight)
    for name in "abc":
        model.add(name, PROMPT, max_tokens=12)  # 8 prompt tokens = 2 blocks, 20 in the end = 5
    results = []
    while model.has_work:
        results.append(model.step())
        assert model.kv_blocks_in_use <= tight.kv_blocks
    preempted = [rid for r in results for rid in r.preempted]
    assert preempted and preempted[0] == "c"  # the most recently started goes first
    assert finish_reasons(results) == {"a": "length", "b": "length", "c": "length"}
    assert {k: len(v) for k, v in tokens_by_request(results).items()} == {"a": 12, "b": 12, "c": 12}
    assert model.kv_blocks_in_use == 0
    # Recompute is paid as prefill, and preemption never changes what a request generates.
    assert sum(r.prefill_tokens for r in results) > 3 * len(PROMPT)
    roomy = SimTimingModel(SimConfig(max_model_len=32))
    for name in "abc":
        roomy.add(name, PROMPT, max_tokens=12)
    assert tokens_by_request(run_to_completion(roomy)) == tokens_by_request(results)


def test_a_resumed_request_computes_only_what_follows_its_cached_blocks() -> None:
    def first_step_prefill(config: SimConfig) -> tuple[int, int]:
        model = SimTimingModel(config)
        model.add("first", PROMPT, max_tokens=7)  # 8 + 6 tokens computed: 3 blocks of 4
        generated = tokens_by_request(run_to_completion(model))["first"]
        model.add("resumed", [*PROMPT, *generated], max_tokens=3)  # 15 tokens
        resumed = model.step().prefill_tokens
        model.add("other", [t + 1 for t in PROMPT] + generated, max_tokens=3)
        return resumed, model.step().prefill_tokens

    cached = SimConfig(block_size=4, max_batched_tokens=256)
    assert first_step_prefill(cached) == (15 - 12, 15)  # a new prefix shares no block
    assert first_step_prefill(SimConfig(block_size=4, prefix_caching=False)) == (15, 15)


def test_a_prompt_held_whole_in_the_cache_still_computes_its_last_block() -> None:
    model = SimTimingModel(SimConfig(block_size=4))
    model.add("a", PROMPT, max_tokens=1)
    run_to_completion(model)
    # Both of its blocks are cached, but its last token must be computed to sample from: the
    # block that holds it is computed again, as vLLM does.
    model.add("b", PROMPT, max_tokens=1)
    assert model.step().prefill_tokens == 4


def test_a_salted_prompt_shares_cached_blocks_with_its_salt_only() -> None:
    """As vLLM's `cache_salt`: blocks cached under one salt are found under that salt alone."""

    def prefill(model: SimTimingModel, name: str, salt: str | None) -> int:
        model.add(name, PROMPT, max_tokens=1, cache_salt=salt)
        return sum(r.prefill_tokens for r in run_to_completion(model))

    model = SimTimingModel(SimConfig(block_size=4))
    assert prefill(model, "a", "tenant-a") == 8
    assert prefill(model, "b", "tenant-b") == 8  # another salt: nothing cached
    assert prefill(model, "c", None) == 8  # no salt: nothing cached either
    assert prefill(model, "a2", "tenant-a") == 4  # its own: all but the last block


def test_a_request_on_an_adapter_without_a_slot_is_passed_over_not_in_the_way() -> None:
    """As vLLM's scheduler: a waiting request whose adapter has no slot stays first in line,
    and the ones behind it that can run do."""
    model = SimTimingModel(SimConfig(max_loras=1))
    model.add("a1", PROMPT, max_tokens=3, adapter="a")
    model.add("b1", PROMPT, max_tokens=3, adapter="b")
    model.add("a2", PROMPT, max_tokens=3, adapter="a")
    model.add("base", PROMPT, max_tokens=3)
    assert sorted(model.step().request_ids) == ["a1", "a2", "base"]
    assert model.slot_waits == 1 and model.num_waiting == 1
    results = run_to_completion(model)
    assert finish_reasons(results)["b1"] == "length"  # once a's last request ended


def test_loading_an_adapter_into_a_slot_costs_its_step_the_load_time() -> None:
    config = dataclasses.replace(EXACT, max_loras=2, lora_load_ms=5.0)

    def first_step(model: SimTimingModel, name: str, adapter: str | None) -> StepResult:
        model.add(name, PROMPT, max_tokens=1, adapter=adapter)
        step = model.step()
        run_to_completion(model)
        return step

    model = SimTimingModel(config)
    base = first_step(model, "base", None)
    loaded = first_step(model, "a1", "a")
    assert (loaded.adapters_loaded, loaded.duration_s - base.duration_s) == (1, pytest.approx(5e-3))
    assert first_step(model, "a2", "a").adapters_loaded == 0  # still in its slot
    assert first_step(model, "b1", "b").adapters_loaded == 1  # the second slot
    assert first_step(model, "c1", "c").adapters_loaded == 1  # into a's slot, least recent
    assert first_step(model, "b2", "b").adapters_loaded == 0
    assert first_step(model, "a3", "a").adapters_loaded == 1


def test_a_step_that_runs_an_adapter_costs_the_lora_step_factor_more() -> None:
    # Every step that runs any adapter's sequence, a base model's beside it or not, costs
    # twice (a step's LoRA products run for the whole batch); the load is its own cost.
    model = SimTimingModel(dataclasses.replace(EXACT, max_loras=2, lora_step_factor=2.0))
    model.add("base", PROMPT, max_tokens=3)
    base = [r.duration_s for r in run_to_completion(model)]
    model.add("base-again", PROMPT, max_tokens=3)
    model.add("on-a", PROMPT, max_tokens=2, adapter="a")
    mixed = [r.duration_s for r in run_to_completion(model)]
    # Alone: 1 ms + 8 prompt tokens, then 1.1 ms a decode step. Beside the adapter's: its
    # prompt too, then two decode tokens, then (the adapter's sequence ended) one, at base cost.
    assert base == pytest.approx([1.08e-3, 1.1e-3, 1.1e-3])
    assert mixed == pytest.approx([2 * 1.16e-3, 2 * 1.2e-3, 1.1e-3])
    with pytest.raises(ValueError, match="lora_step_factor"):
        SimConfig(lora_step_factor=0.5)


def test_an_adapter_draws_its_own_tokens_and_caches_its_own_blocks() -> None:
    model = SimTimingModel(SimConfig(block_size=4, max_loras=2))

    def run(name: str, adapter: str | None) -> tuple[list[int], int]:
        model.add(name, PROMPT, max_tokens=4, seed=7, adapter=adapter)
        results = run_to_completion(model)
        return tokens_by_request(results)[name], sum(r.prefill_tokens for r in results)

    base, _ = run("base", None)
    on_a, a_prefill = run("a", "a")
    assert on_a != base
    assert a_prefill == 8  # the base model's blocks are not the adapter's
    assert run("b", "b")[1] == 8
    assert run("a-again", "a") == (on_a, 4)  # its own: all but the last block
    with pytest.raises(ValueError, match="no LoRA"):
        SimTimingModel().add("x", PROMPT, max_tokens=1, adapter="a")


def test_a_new_sequence_waits_until_its_blocks_fit() -> None:
    model = SimTimingModel(SimConfig(block_size=4, kv_blocks=8, max_model_len=32))
    model.add("big", [7] * 28, max_tokens=2)  # 7 blocks
    model.add("small", PROMPT, max_tokens=2)  # 2 blocks: does not fit beside "big"
    model.step()
    assert (model.num_running, model.num_waiting, model.kv_blocks_in_use) == (1, 1, 7)
    results = run_to_completion(model)
    assert finish_reasons(results) == {"big": "length", "small": "length"}


def test_max_num_seqs_caps_the_running_set() -> None:
    model = SimTimingModel(SimConfig(max_num_seqs=2))
    for i in range(3):
        model.add(f"r{i}", PROMPT, max_tokens=3)
    model.step()
    assert (model.num_running, model.num_waiting) == (2, 1)
    assert len(finish_reasons(run_to_completion(model))) == 3


def test_abort_frees_blocks_immediately() -> None:
    model = SimTimingModel(SimConfig(block_size=4))
    model.add("a", PROMPT, max_tokens=100)
    model.add("b", PROMPT, max_tokens=100)
    model.step()
    assert model.kv_blocks_in_use == 4
    assert model.abort("a") is True
    assert (model.kv_blocks_in_use, model.num_unfinished) == (2, 1)
    assert model.abort("a") is False
    assert model.abort("b") is True
    assert (model.kv_blocks_in_use, model.has_work) == (0, False)
    model.add("waiting", PROMPT, max_tokens=1)
    assert model.abort("waiting") is True and not model.has_work


def test_same_inputs_give_the_same_tokens_and_durations() -> None:
    def run() -> list[StepResult]:
        tight = SimConfig(block_size=4, kv_blocks=16, max_model_len=64, eos_probability=0.05)
        model = SimTimingModel(tight)  # tight enough to preempt: the schedule is deterministic too
        for i in range(10):
            model.add(f"req-{i}", PROMPT[: 1 + i % 8], max_tokens=40)
        return run_to_completion(model)

    assert run() == run()


def test_a_model_that_reports_no_tokens_keeps_the_same_schedule_and_tokens() -> None:
    # Tight enough to preempt and to cache blocks that hold generated tokens; half the
    # requests may end by a draw, so those draw as they step and the rest only when read.
    tight = SimConfig(block_size=4, kv_blocks=16, max_model_len=64, eos_probability=0.05)

    def run(report_tokens: bool) -> tuple[list[StepResult], dict[str, list[int]]]:
        model = SimTimingModel(tight, report_tokens=report_tokens)
        for i in range(10):
            model.add(f"req-{i}", PROMPT[: 1 + i % 8], max_tokens=40, ignore_eos=i % 2 == 0)
        results, read = [], {}
        while model.has_work:
            results.append(model.step())
            if len(results) % 7 == 0:  # read mid-run, as the simulator does at a preemption
                last = results[-1]
                running = [
                    r
                    for r, end in zip(last.request_ids, last.finish_reasons, strict=True)
                    if not end
                ]
                read |= {rid: model.token_ids(rid) for rid in running[:2]}
        return results, read

    reported, read_reported = run(True)
    counted, read_counted = run(False)
    assert all(not r.token_ids for r in counted) and any(r.preempted for r in counted)
    assert [dataclasses.replace(r, token_ids=[]) for r in reported] == counted
    assert read_counted == read_reported and read_counted


def test_seed_decides_the_tokens_else_the_request_id() -> None:
    model = SimTimingModel()
    model.add("x", PROMPT, max_tokens=20, seed=42)
    model.add("y", PROMPT, max_tokens=20, seed=42)
    model.add("z", PROMPT, max_tokens=20)
    tokens = tokens_by_request(run_to_completion(model))
    assert tokens["x"] == tokens["y"] != tokens["z"]
    assert all(len(SPECIAL_TOKENS) <= t < SimConfig().vocab_size for t in tokens["z"])


def test_tokens_are_drawn_as_random_random_draws_them() -> None:
    # Each token as rng.randrange(first word, vocab_size), then one rng.random() for the end
    # test, from random.Random(seed): the stream the model documents (and tests rely on).
    model = SimTimingModel()
    for seed in (0, 7, 2**63 + 12345):
        model.add(f"s{seed}", PROMPT, max_tokens=50, seed=seed)
    model.add("by-id", PROMPT, max_tokens=50)
    tokens = tokens_by_request(run_to_completion(model))
    for rid, seed in [
        *((f"s{s}", s) for s in (0, 7, 2**63 + 12345)),
        ("by-id", stable_hash("by-id")),
    ]:
        rng = random.Random(seed)
        expected = []
        for _ in range(50):
            expected.append(rng.randrange(len(SPECIAL_TOKENS), SimConfig().vocab_size))
            rng.random()
        assert tokens[rid] == expected


def test_finishes_with_length_at_max_tokens_or_max_model_len() -> None:
    model = SimTimingModel(SimConfig(max_model_len=32))
    model.add("tokens", PROMPT, max_tokens=5)
    model.add("model_len", [7] * 30, max_tokens=100)
    results = run_to_completion(model)
    assert finish_reasons(results) == {"tokens": "length", "model_len": "length"}
    assert {k: len(v) for k, v in tokens_by_request(results).items()} == {
        "tokens": 5,
        "model_len": 2,
    }


def test_eos_stops_but_not_before_min_tokens_nor_with_ignore_eos() -> None:
    model = SimTimingModel(SimConfig(eos_probability=1.0))
    model.add("eos", PROMPT, max_tokens=10)
    model.add("min", PROMPT, max_tokens=10, min_tokens=4)
    model.add("ignore", PROMPT, max_tokens=10, ignore_eos=True)
    results = run_to_completion(model)
    assert finish_reasons(results) == {"eos": "stop", "min": "stop", "ignore": "length"}
    assert {k: len(v) for k, v in tokens_by_request(results).items()} == {
        "eos": 1,
        "min": 4,
        "ignore": 10,
    }


def test_eos_probability_zero_never_stops() -> None:
    model = SimTimingModel()
    model.add("a", PROMPT, max_tokens=300)
    assert finish_reasons(run_to_completion(model)) == {"a": "length"}


def test_requests_that_can_never_run_are_refused() -> None:
    model = SimTimingModel(SimConfig(max_model_len=32, block_size=4, kv_blocks=8))
    with pytest.raises(ValueError, match="max_model_len"):
        model.add("long", [7] * 33, max_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        model.add("empty", [], max_tokens=1)
    for ids in ([7, 2048, 8], [7, -1], range(2040, 2049), range(-1, 5), range(5, -2, -3)):
        with pytest.raises(ValueError, match="token ids"):  # 2048: the vocabulary's end
            model.add("out of vocabulary", ids, max_tokens=1)
    model.add("a", PROMPT, max_tokens=1)
    with pytest.raises(ValueError, match="already"):
        model.add("a", PROMPT, max_tokens=1)
    with pytest.raises(ValueError, match="KV pool"):
        SimConfig(block_size=4, kv_blocks=2, max_model_len=32)


def test_cli_arguments_round_trip_to_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    assert SimConfig.from_args(parser.parse_args([])) == SimConfig()
    args = parser.parse_args(
        ["--sim-step-base-ms", "3", "--sim-kv-blocks", "64", "--sim-eos-probability", "0.1"]
    )
    assert SimConfig.from_args(args) == SimConfig(
        step_base_ms=3.0, kv_blocks=64, eos_probability=0.1
    )


# --------------------------------------------------------------------------- engine client

FAST = SimConfig(step_base_ms=0.5, decode_ms_per_token=0.05, prefill_ms_per_token=0.001)


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    sim = SimEngine(FAST, model_name="sim-test")
    await sim.start()
    yield sim
    await sim.stop()


def request(request_id: str, max_tokens: int = 16, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        PROMPT,
        SamplingOptions(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def collect(engine: SimEngine, req: GenerationRequest) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(req)]


async def test_engine_satisfies_the_protocol_and_reports_its_config(engine: SimEngine) -> None:
    assert isinstance(engine, EngineClient)
    assert engine.model.name == "sim-test" and engine.model.max_model_len == FAST.max_model_len
    assert engine.model.path == "sim-test"
    limits = engine.model.limits
    assert (limits.max_num_seqs, limits.max_batched_tokens) == (
        FAST.max_num_seqs,
        FAST.max_batched_tokens,
    )
    assert limits.kv_cache == KVCacheInfo(block_size=FAST.block_size, num_blocks=FAST.kv_blocks)
    assert engine.is_healthy
    await engine.check_health()


async def test_streams_a_request_to_completion(engine: SimEngine) -> None:
    deltas = await asyncio.wait_for(collect(engine, request("a", max_tokens=16)), 5)
    token_ids = [t for d in deltas for t in d.token_ids]
    assert len(token_ids) == 16
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert "".join(d.text for d in deltas) == detokenize(token_ids)
    assert all(word in WORDS for word in detokenize(token_ids).split())
    assert engine.num_unfinished_requests() == 0
    # The loop went idle; a later request wakes it again, with the same seeded tokens.
    again = await asyncio.wait_for(collect(engine, request("b", max_tokens=16, seed=1)), 5)
    same = await asyncio.wait_for(collect(engine, request("c", max_tokens=16, seed=1)), 5)
    assert [d.token_ids for d in again] == [d.token_ids for d in same]


async def test_step_durations_pass_on_the_loop_clock() -> None:
    config = SimConfig(step_base_ms=10.0, decode_ms_per_token=0.0)
    model = SimTimingModel(config)
    model.add("a", PROMPT, 5)
    steps = run_to_completion(model)
    assert len(steps) == 5  # prefill and the first token, then 4 decodes
    sim = SimEngine(config)
    await sim.start()
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(collect(sim, request("a", max_tokens=5)), 5)
        assert loop.time() - started == pytest.approx(sum(step.duration_s for step in steps))
    finally:
        await sim.stop()


async def test_a_held_gate_lets_only_the_steps_it_is_given_begin_each_at_once() -> None:
    sim = SimEngine(SimConfig(step_base_ms=10.0, decode_ms_per_token=0.0))
    await sim.start()
    try:
        loop = asyncio.get_running_loop()
        sim.gate.hold()
        stream = sim.generate(request("a", max_tokens=50))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(1.0)  # (virtual time: a hundred steps' time, and none began)
        assert not first.done() and sim.timing_model.num_waiting == 1
        started = loop.time()
        sim.gate.step(2)
        deltas = [await first, await anext(stream)]
        assert [len(d.token_ids) for d in deltas] == [1, 1]
        assert loop.time() == started  # a step let through is not waited for
        third = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(1.0)
        assert not third.done() and sim.gate.held  # held again after the two
        await sim.abort("a")  # a held request is still aborted at once
        assert (await third).finish_reason == "abort"
        assert sim.num_unfinished_requests() == 0
        with pytest.raises(ValueError):
            sim.gate.step(0)
    finally:
        await sim.stop()


async def test_an_unpaced_gate_runs_steps_back_to_back_and_open_brings_back_the_pace() -> None:
    config = SimConfig(step_base_ms=10.0, decode_ms_per_token=0.0)
    model = SimTimingModel(config)
    model.add("b", PROMPT, 5)
    paced_s = sum(step.duration_s for step in run_to_completion(model))
    sim = SimEngine(config)
    await sim.start()
    try:
        loop = asyncio.get_running_loop()
        sim.gate.open(paced=False)
        started = loop.time()
        deltas = await asyncio.wait_for(collect(sim, request("a", max_tokens=5)), 5)
        assert sum(len(d.token_ids) for d in deltas) == 5 and loop.time() == started
        sim.gate.open()
        started = loop.time()
        await asyncio.wait_for(collect(sim, request("b", max_tokens=5)), 5)
        assert loop.time() - started == pytest.approx(paced_s)
    finally:
        await sim.stop()


@pytest.mark.looptime(False)  # a loop that falls behind: on the wall clock
@pytest.mark.parametrize("catch_up", [0, 8])
async def test_with_catch_up_a_busy_loop_gets_the_steps_it_missed_as_one_delta(
    catch_up: int,
) -> None:
    """The loop blocked for 15 steps' time: an engine keeping its own clock ran up to
    `catch_up_steps` of them meanwhile, and the stream's next delta carries their tokens (one
    step's more, the one that ended the wait); an engine that waits for the loop ran one."""
    sim = SimEngine(SimConfig(step_base_ms=2.0, decode_ms_per_token=0.0, catch_up_steps=catch_up))
    await sim.start()
    try:
        stream = sim.generate(request("a", max_tokens=200, ignore_eos=True))
        first = await asyncio.wait_for(anext(stream), 5)  # prefilled, its first token taken
        time.sleep(0.03)  # noqa: ASYNC251  (the point: the loop busy with other work, 15 steps long)
        # On a busy host the engine's task may have run steps between the first delta and the
        # block (before this task resumed), and the loop may fall behind again later: the
        # caught-up delta is somewhere after the block, and no delta carries more than it.
        rest = await asyncio.wait_for(collect_rest(stream), 10)
        assert max(len(d.token_ids) for d in rest) == (1 if catch_up == 0 else catch_up + 1)
        assert sum(len(d.token_ids) for d in [first, *rest]) == 200
    finally:
        await sim.stop()


async def test_two_concurrent_requests_interleave(engine: SimEngine) -> None:
    arrivals: list[str] = []

    async def consume(name: str) -> None:
        async for _ in engine.generate(request(name, max_tokens=20)):
            arrivals.append(name)

    await asyncio.wait_for(asyncio.gather(consume("a"), consume("b")), 5)
    last_a = len(arrivals) - 1 - arrivals[::-1].index("a")
    last_b = len(arrivals) - 1 - arrivals[::-1].index("b")
    assert arrivals.index("b") < last_a and arrivals.index("a") < last_b
    assert engine.num_unfinished_requests() == 0


async def test_closing_the_stream_early_aborts_the_request(engine: SimEngine) -> None:
    stream = engine.generate(request("a", max_tokens=10_000, ignore_eos=True))
    first = await asyncio.wait_for(anext(stream), 5)
    assert first.token_ids and engine.num_unfinished_requests() == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.num_unfinished_requests() == 0
    assert engine.timing_model.kv_blocks_in_use == 0


async def test_cancelling_the_consumer_aborts_the_request(engine: SimEngine) -> None:
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(request("a", max_tokens=10_000)):
            got_first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_first.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_unfinished_requests() == 0


async def test_abort_ends_the_stream_with_finish_reason_abort(engine: SimEngine) -> None:
    stream = engine.generate(request("a", max_tokens=10_000))
    await asyncio.wait_for(anext(stream), 5)
    await engine.abort("a")
    assert engine.num_unfinished_requests() == 0
    rest = await asyncio.wait_for(collect_rest(stream), 5)
    assert rest[-1].finish_reason == "abort"


async def collect_rest(stream: AsyncIterator[TokenDelta]) -> list[TokenDelta]:
    return [delta async for delta in stream]


async def test_kill_fails_in_flight_streams_and_health(engine: SimEngine) -> None:
    stream = engine.generate(request("a", max_tokens=10_000))
    await asyncio.wait_for(anext(stream), 5)
    engine.kill()
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect_rest(stream), 5)
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    assert not engine.is_healthy
    assert engine.num_unfinished_requests() == 0
    with pytest.raises(EngineDeadError):
        await collect(engine, request("b"))


async def test_stop_fails_outstanding_generations() -> None:
    sim = SimEngine(FAST)
    await sim.start()
    stream = sim.generate(request("a", max_tokens=10_000))
    await asyncio.wait_for(anext(stream), 5)
    await asyncio.wait_for(sim.stop(), 5)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(collect_rest(stream), 5)


async def test_invalid_request_is_refused(engine: SimEngine) -> None:
    too_long = GenerationRequest("a", [7] * (FAST.max_model_len + 1), SamplingOptions(max_tokens=1))
    with pytest.raises(EngineRequestError):
        await collect(engine, too_long)
    assert engine.is_healthy and engine.num_unfinished_requests() == 0


def test_tokenize_and_chat_template_are_deterministic_and_in_vocab() -> None:
    sim = SimEngine(SimConfig(vocab_size=2048))
    ids = sim.tokenize("The quick brown fox, naturally!")
    assert ids == sim.tokenize("The quick brown fox, naturally!")
    assert all(len(SPECIAL_TOKENS) <= t < 2048 for t in ids)
    assert detokenize(sim.tokenize("The quick dog")) == " the quick dog"
    chat = sim.render_chat(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
        ]
    )
    bos, eos, system, user, assistant = (
        SPECIAL_TOKENS.index(t)
        for t in ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
    )
    body = sim.tokenize("be brief")
    assert chat == [bos, system, *body, eos, user, *sim.tokenize("hello world"), eos, assistant]


async def test_a_failing_step_makes_the_engine_dead(engine: SimEngine) -> None:
    def broken_step() -> StepResult:
        raise RuntimeError("model bug")

    engine.timing_model.step = broken_step  # type: ignore[method-assign]
    with pytest.raises(EngineDeadError, match="model bug"):
        await asyncio.wait_for(collect(engine, request("a")), 5)
    assert not engine.is_healthy
