"""`sim-batch`: a model of an engine that runs whole batches in a fixed time.

Every batch takes `batch_time_s` whatever its size, up to `max_batch` requests; each request
gets `max_tokens` tokens drawn deterministically from a fixed vocabulary. Failures can be
injected: a batch containing a poison marker in any prompt crashes its worker halfway through,
a worker can be killed mid-batch, and batches can fail at a seeded random rate.

`BatchModel` is the pure model (no clock): the discrete-event simulator reads it directly.
`SimBatchEngine` runs it on the wall clock with asyncio, one `run_batch` per worker at a time,
and also implements `EngineClient` (a lone `generate` is a batch of one) so the server can
tokenize through it. The tokenizer is byte-level: token ids 0-255 are UTF-8 bytes, so the
poison marker is visible in `prompt_token_ids`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import (
    EngineDeadError,
    EngineError,
    EngineLimits,
    EngineStats,
    GenerationRequest,
    KVCacheInfo,
    ModelInfo,
    OutputPlan,
    OutputRequest,
    PromptEmbeds,
    TokenDelta,
    no_adapters,
    no_prompt_embeds,
    plain_text_only,
)

VOCABULARY = (
    " the",
    " batch",
    " leaves",
    " at",
    " ten",
    " milliseconds",
    " and",
    " finishes",
    " later",
    " a",
    " worker",
    " waits",
    " for",
    " more",
    " passengers",
    " shuttle",
)
_FIRST_WORD_ID = 256
DEFAULT_POISON_MARKER = "POISON"


class WorkerCrashed(EngineError):
    """A worker died while running a batch; every request in that batch is unfinished."""


@dataclass(frozen=True, slots=True)
class BatchItem:
    request_id: str
    attempt_id: int
    prompt_token_ids: Sequence[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class BatchItemResult:
    """One request's whole response, tagged with the attempt that produced it."""

    request_id: str
    attempt_id: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = "length"


@dataclass(frozen=True, slots=True)
class BatchModel:
    """Timing, output and failure rules of the fixed-time batch engine (no clock inside)."""

    batch_time_s: float = 0.1
    max_batch: int = 32
    poison_marker: str | None = DEFAULT_POISON_MARKER
    crash_fraction: float = 0.5  # how far into the batch a crash happens
    _marker_ids: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if self.batch_time_s <= 0 or self.max_batch < 1:
            raise ValueError("batch_time_s must be > 0 and max_batch >= 1")
        marker = tuple(tokenize(self.poison_marker)) if self.poison_marker else ()
        object.__setattr__(self, "_marker_ids", marker)

    def is_poison(self, prompt_token_ids: Sequence[int]) -> bool:
        marker = self._marker_ids
        if not marker:
            return False
        n = len(marker)
        ids = list(prompt_token_ids)
        return any(tuple(ids[i : i + n]) == marker for i in range(len(ids) - n + 1))

    def is_poison_text(self, prompt: str) -> bool:
        return bool(self.poison_marker) and self.poison_marker in prompt  # type: ignore[operator]

    def crash_after_s(self) -> float:
        return self.batch_time_s * self.crash_fraction

    def output(self, item: BatchItem) -> BatchItemResult:
        start = len(item.prompt_token_ids)
        words = tuple((start + k) % len(VOCABULARY) for k in range(item.max_tokens))
        text = "".join(VOCABULARY[w] for w in words)
        ids = tuple(_FIRST_WORD_ID + w for w in words)
        return BatchItemResult(item.request_id, item.attempt_id, text, ids)


def tokenize(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class SimBatchEngine:
    """The batch model on the wall clock: `run_batch` sleeps the batch time, then answers."""

    def __init__(
        self,
        model: BatchModel,
        *,
        name: str = "sluice-demo",
        max_model_len: int = 4096,
        fail_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.batch_model = model
        # One batch's seats; a batch holds each of its sequences whole, so its KV cache is one
        # block of max_model_len tokens a seat.
        seats = model.max_batch
        self._info = ModelInfo(
            name=name,
            path=name,
            max_model_len=max_model_len,
            limits=EngineLimits(
                max_num_seqs=seats,
                max_batched_tokens=seats * max_model_len,
                kv_cache=KVCacheInfo(block_size=max_model_len, num_blocks=seats),
                adapter_slots=0,
            ),
            vocab_size=256,  # bytes
            engine="sim-batch",
            logprobs=False,
            choices=False,
            beam_search=False,
        )
        self._fail_rate = fail_rate
        self._rng = random.Random(seed)
        self._kills: dict[int, asyncio.Event] = {}
        self._running = 0
        self._started = False
        self._stats = EngineStats()  # its batches' tokens; the rest is read (`stats`)

    # --- the batch API the batch runtime uses ---
    async def run_batch(self, worker_id: int, items: Sequence[BatchItem]) -> list[BatchItemResult]:
        """Run one batch on `worker_id`; raise WorkerCrashed if the worker dies meanwhile."""
        if not self._started:
            raise EngineDeadError("sim-batch engine is not started")
        if len(items) > self.batch_model.max_batch:
            raise EngineError(f"batch of {len(items)} exceeds {self.batch_model.max_batch}")
        kill = self._kills.setdefault(worker_id, asyncio.Event())  # may hold a pending kill
        self._running += len(items)
        try:
            crash = any(self.batch_model.is_poison(i.prompt_token_ids) for i in items)
            crash = crash or (self._fail_rate > 0 and self._rng.random() < self._fail_rate)
            limit = self.batch_model.crash_after_s() if crash else self.batch_model.batch_time_s
            try:
                await asyncio.wait_for(kill.wait(), timeout=limit)
            except TimeoutError:
                if crash:
                    raise WorkerCrashed(f"worker {worker_id} crashed mid-batch") from None
                # A batch is one step here: it computes its prompts and answers at once.
                self._stats.count_step(sum(len(i.prompt_token_ids) + i.max_tokens for i in items))
                return [self.batch_model.output(i) for i in items]
            raise WorkerCrashed(f"worker {worker_id} was killed mid-batch")
        finally:
            self._running -= len(items)
            if self._kills.get(worker_id) is kill:
                del self._kills[worker_id]

    def kill_worker(self, worker_id: int) -> None:
        """Failure injection: the batch `worker_id` is running (or runs next) dies."""
        self._kills.setdefault(worker_id, asyncio.Event()).set()

    # --- EngineClient ---
    @property
    def model(self) -> ModelInfo:
        return self._info

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        self._started = False
        for event in self._kills.values():
            event.set()

    async def check_health(self) -> None:
        if not self._started:
            raise EngineDeadError("sim-batch engine is not started")

    @property
    def is_healthy(self) -> bool:
        return self._started

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode("utf-8", "replace")

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [bytes([t]).decode("latin-1") for t in token_ids]

    def plan_output(self, request: OutputRequest) -> OutputPlan:
        return plain_text_only(request, self.model.engine)

    def load_prompt_embeds(self, data: str) -> PromptEmbeds:
        raise no_prompt_embeds(self.model.engine)

    async def load_adapter(self, name: str, path: str) -> None:
        raise no_adapters(self.model.engine)

    async def unload_adapter(self, name: str) -> None:
        raise no_adapters(self.model.engine)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = "".join(f"<{m.get('role', 'user')}>{m.get('content', '')}\n" for m in messages)
        return tokenize(text)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        item = BatchItem(
            request.request_id, 0, request.prompt_token_ids, request.sampling.max_tokens
        )
        (result,) = await self.run_batch(-1, [item])
        yield TokenDelta(result.text, result.token_ids, finish_reason=result.finish_reason)

    async def abort(self, request_id: str) -> None:
        """Batches cannot be stopped part-way; the batch runtime fences their results."""

    def num_unfinished_requests(self) -> int:
        return self._running

    def stats(self) -> EngineStats:
        """Every running sequence holds a block (one seat of one batch's cache; several workers
        may run more than a batch holds); nothing waits inside, nothing is cached."""
        stats = self._stats
        stats.running = self._running
        stats.kv_cache_usage = min(1.0, self._running / self._info.limits.kv_cache.num_blocks)
        return stats
