"""BatchRuntime with the sim-batch engine, in virtual time: the loop's clock jumps to the next
timer whenever nothing can run (looptime), so a batch costs no wall time. The runtime and the
tickets read that clock too."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import pytest

from engine_adapters.protocol import GenerationRequest, SamplingOptions, TokenDelta
from engine_adapters.sim_batch import BatchModel, SimBatchEngine, tokenize
from server.core.errors import DeadlineUnmeetable, GenerationFailed, Overloaded
from server.fixed_batch.decisions import BatchConfig
from server.fixed_batch.runtime import BatchRuntime
from server.observability.metrics import Metrics
from server.scheduler.types import Ticket, TrafficClass

MODEL = "sluice-demo"

pytestmark = pytest.mark.looptime


def make(
    *, batch_s: float = 0.02, max_batch: int = 4, workers: int = 1, **config: object
) -> tuple[SimBatchEngine, BatchRuntime]:
    engine = SimBatchEngine(BatchModel(batch_s, max_batch), name=MODEL)
    cfg = BatchConfig(
        workers=(MODEL,) * workers,
        batch_time_s=batch_s,
        max_batch=max_batch,
        max_delay_s=0.005,
        **config,
    )  # type: ignore[arg-type]
    return engine, BatchRuntime(cfg, engine, Metrics(), clock=asyncio.get_running_loop().time)


@pytest.fixture
async def runtime() -> AsyncIterator[tuple[SimBatchEngine, BatchRuntime]]:
    engine, rt = make()
    await engine.start()
    await rt.start()
    yield engine, rt
    await rt.stop()
    await engine.stop()


def now() -> float:
    return asyncio.get_running_loop().time()


def request(
    rid: str, prompt: str = "hello", *, deadline: float = math.inf
) -> tuple[Ticket, GenerationRequest]:
    ids = tokenize(prompt)
    ticket = Ticket(rid, "default", TrafficClass.INTERACTIVE, MODEL, now(), deadline, len(ids), 4)
    return ticket, GenerationRequest(rid, ids, SamplingOptions(max_tokens=4))


async def generate(
    rt: BatchRuntime, rid: str, prompt: str = "hello", entered: asyncio.Event | None = None
) -> tuple[float, list[TokenDelta]]:
    ticket, req = request(rid, prompt)
    async with rt.generation(ticket, req) as gen:
        if entered is not None:
            entered.set()
        return gen.dispatched_at, [d async for d in gen]


def sample(rt: BatchRuntime, name: str) -> float:
    """`name`'s value in the runtime's own registry (0 before its first event)."""
    return rt.metrics.registry.get_sample_value(name, {"model": MODEL}) or 0.0


async def test_concurrent_requests_share_one_batch_and_get_whole_responses(runtime) -> None:
    _, rt = runtime
    arrived = now()
    results = await asyncio.gather(*(generate(rt, f"R{i}") for i in range(4)))
    assert {dispatched for dispatched, _ in results} == {arrived}  # full: no batching delay
    assert now() - arrived == pytest.approx(0.02)  # one batch time
    for _, deltas in results:
        (delta,) = deltas
        assert len(delta.token_ids) == 4 and delta.finish_reason == "length" and delta.text
    assert sample(rt, "sluice_batch_size_count") == 1


async def test_an_unmeetable_deadline_is_refused_at_admission() -> None:
    engine, rt = make(batch_s=30.0)
    await engine.start()
    await rt.start()
    entered = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(generate(rt, f"R{i}", entered=e)) for i, e in enumerate(entered)]
    await asyncio.gather(*(e.wait() for e in entered))
    ticket, req = request("E", deadline=now() + 1.0)
    with pytest.raises(DeadlineUnmeetable):
        async with rt.generation(ticket, req):
            pass
    await rt.stop()
    await engine.stop()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_full_queue_answers_overloaded() -> None:
    engine, rt = make(batch_s=30.0, max_batch=1, max_queue=1)
    await engine.start()
    await rt.start()
    entered = asyncio.Event()
    running = asyncio.create_task(generate(rt, "R0", entered=entered))
    await entered.wait()
    queued = asyncio.create_task(generate(rt, "R1"))
    await asyncio.sleep(0)  # one loop turn: the new task runs up to its wait in the queue
    assert rt.core.queue_depth(MODEL) == 1
    ticket, req = request("R2")
    with pytest.raises(Overloaded):
        async with rt.generation(ticket, req):
            pass
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    assert rt.core.queue_depth(MODEL) == 0  # the cancelled request left the queue
    await rt.stop()
    await engine.stop()
    await asyncio.gather(running, return_exceptions=True)


async def test_a_poison_request_fails_alone_and_its_batch_mates_complete(runtime) -> None:
    _, rt = runtime
    results = await asyncio.gather(
        generate(rt, "R0"),
        generate(rt, "P", prompt="a POISON prompt"),
        generate(rt, "R1"),
        generate(rt, "R2"),
        return_exceptions=True,
    )
    poison = results[1]
    assert isinstance(poison, GenerationFailed) and "alone" in poison.message
    for result in (results[0], results[2], results[3]):
        assert not isinstance(result, BaseException)
        assert len(result[1]) == 1


async def test_a_worker_killed_mid_batch_has_its_requests_retried(runtime) -> None:
    engine, rt = runtime
    entered = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(generate(rt, f"R{i}", entered=e)) for i, e in enumerate(entered)]
    await asyncio.gather(*(e.wait() for e in entered))
    engine.kill_worker(0)
    results = await asyncio.gather(*tasks)
    assert all(len(deltas) == 1 for _, deltas in results)
    assert sample(rt, "sluice_worker_failures_total") == 1
    assert sample(rt, "sluice_batch_retries_total") == 4


async def test_cancelling_a_running_request_fences_it_and_the_rest_complete(runtime) -> None:
    _, rt = runtime
    entered = [asyncio.Event() for _ in range(4)]
    tasks = [asyncio.create_task(generate(rt, f"R{i}", entered=e)) for i, e in enumerate(entered)]
    await asyncio.gather(*(e.wait() for e in entered))
    tasks[0].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert all(len(r[1]) == 1 for r in results[1:])  # type: ignore[index]
    assert rt.core.live_requests == 0
