"""The `sim` engine on the wall clock: `SimEngine` drives `SimTimingModel` (see
`engine_adapters/sim_model.py` for the model) inside the server, as an `EngineClient`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from engine_adapters.protocol import (
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    OutputPlan,
    OutputRequest,
    PromptEmbeds,
    PromptLogprob,
    TokenDelta,
    TokenLogprob,
    no_adapters,
    no_prompt_embeds,
    plain_text_only,
    token_id_name,
)
from engine_adapters.sim_gate import StepGate
from engine_adapters.sim_model import (
    BOS_ID,
    EOS_ID,
    ROLE_IDS,
    SPECIAL_TOKENS,
    TOKEN_PATTERN,
    WORD_IDS,
    SimConfig,
    SimTimingModel,
    StepResult,
    add_sim_arguments,
    detokenize,
    stable_hash,
    token_text,
)

__all__ = ["SimConfig", "SimEngine", "SimTimingModel", "StepGate", "add_sim_arguments"]

_log = logging.getLogger(__name__)
MAX_LAG_S = 0.05  # lateness behind the engine's clock kept, at most


@dataclass(slots=True, eq=False)
class _Stream:
    """Tokens the engine produced for one request that its consumer has not taken yet."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    num_cached_tokens: int | None = None  # until the first delta takes it


class SimEngine:
    """`EngineClient` over `SimTimingModel` on the wall clock.

    One background task runs steps: the model decides the step at once, the step's duration
    passes in `asyncio.sleep` (the engine's compute), then its tokens reach the streams. Deltas
    coalesce when a consumer falls behind. `kill()` simulates the engine process dying.

    With `catch_up_steps` (N), the steps keep the engine's own clock, as an engine in a
    process of its own (vLLM's) does while the API's loop is busy: a step whose time passed
    before the loop let this task run is not slept for, and the next one runs at once. Up to
    N run back to back before the loop runs others, their tokens reaching each stream as one
    delta, and lateness beyond `MAX_LAG_S` is forgotten (the model's own CPU is on this loop:
    catching up without end would starve it). With the loop on time, nothing changes: one step
    a wake. Without (0), every step waits for the loop.

    `gate` (a `StepGate`) says when a step may begin: open at the model's pace by default; a
    test holds it to keep a request running while others arrive, and lets steps through.

    Of `SamplingOptions` only max_tokens, min_tokens, ignore_eos and seed change the output.
    Chat template: `<|bos|>`, then per message `<|role|>` (system/user/assistant; other roles as
    the words `role :`), the content, `<|eos|>`; then `<|assistant|>` (the generation prompt;
    with `continue_final_message` the last message's `<|eos|>` is left off instead).
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        model_name: str = "sim",
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        """`adapters`: LoRA adapters served as models from the start, name to path (a label:
        the sim reads no weights; an adapter's requests draw tokens of their own), with
        `config.max_loras` slots; any number more may be loaded at runtime."""
        self.config = config or SimConfig()
        self._model = SimTimingModel(self.config)
        self._adapters = dict(adapters or {})
        if self._adapters and not self.config.max_loras:
            raise ValueError("adapters need LoRA slots (max_loras)")
        self._model_info = self.config.model_info(model_name, MappingProxyType(self._adapters))
        self._streams: dict[str, _Stream] = {}
        self._finishing: set[str] = set()  # finished by the step now passing, not yet delivered
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None
        self._stats = EngineStats()  # its counts; the rest is read from the model (`stats`)
        self.gate = StepGate()

    @property
    def model(self) -> ModelInfo:
        return self._model_info

    @property
    def timing_model(self) -> SimTimingModel:
        return self._model

    async def start(self) -> None:
        if self._task is None and self._dead is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task = self._task
        self._die(EngineDeadError("the sim engine was stopped"))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def kill(self) -> None:
        """Make the engine dead now, as if its process crashed (for engine-death tests)."""
        self._die(EngineDeadError("the sim engine was killed"))
        if self._task is not None:
            self._task.cancel()

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    @property
    def is_healthy(self) -> bool:
        return self._task is not None and self._dead is None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Known words (case-insensitive) to their ids, others to a stable hash in the vocab.
        Raw text gets no special tokens added, whatever `add_special_tokens` says."""
        vocab = self.config.vocab_size
        ids = []
        for piece in TOKEN_PATTERN.findall(text):
            if piece in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS.index(piece))
            else:
                word_id = WORD_IDS.get(piece.lower())
                if word_id is None or word_id >= vocab:
                    word_id = len(SPECIAL_TOKENS) + stable_hash(piece) % (
                        vocab - len(SPECIAL_TOKENS)
                    )
                ids.append(word_id)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return detokenize(token_ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [SPECIAL_TOKENS[t] if t < len(SPECIAL_TOKENS) else token_text(t) for t in token_ids]

    def _candidates(self, token_id: int, k: int) -> list[tuple[int, float]]:
        """Made-up but consistent: the token itself is the likeliest, at a log-probability
        set by its id; the next ids follow, one nat apart each (the k together under 1)."""
        logprob = -0.5 - (token_id % 7) * 0.1
        vocab = self.config.vocab_size - len(SPECIAL_TOKENS)
        ids = [token_id] + [len(SPECIAL_TOKENS) + (token_id + i) % vocab for i in range(1, k)]
        return [(t, logprob - i) for i, t in enumerate(ids)]

    def _logprob(self, token_id: int, k: int, as_ids: bool = False) -> TokenLogprob:
        name = token_id_name if as_ids else token_text
        best = self._candidates(token_id, max(1, k))
        return TokenLogprob(name(token_id), best[0][1], tuple((name(t), lp) for t, lp in best[:k]))

    def _prompt_logprob(self, token_id: int, k: int, as_ids: bool) -> list[PromptLogprob]:
        """A prompt position: its token ranked first, and the k likeliest (at least it)."""
        name = token_id_name if as_ids else token_text
        return [
            PromptLogprob(t, name(t), lp, rank)
            for rank, (t, lp) in enumerate(self._candidates(token_id, max(1, k)), start=1)
        ]

    def plan_output(self, request: OutputRequest) -> OutputPlan:
        return plain_text_only(request, self.model.engine)

    def load_prompt_embeds(self, data: str) -> PromptEmbeds:
        raise no_prompt_embeds(self.model.engine)

    async def load_adapter(self, name: str, path: str) -> None:
        if not self.config.max_loras:
            raise no_adapters(self.model.engine)
        if name == self.model.name or name in self._adapters:
            raise EngineRequestError(f"the adapter '{name}' is already loaded", param="lora_name")
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        # (Its running requests finish: the timing model serves any adapter it is given.)
        if self._adapters.pop(name, None) is None:
            raise EngineRequestError(f"the adapter '{name}' is not loaded", param="lora_name")

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        ids = [BOS_ID]
        for message in messages:
            role = str(message.get("role", "user"))
            role_id = ROLE_IDS.get(role)
            ids.extend([role_id] if role_id is not None else self.tokenize(f"{role} :"))
            content = message.get("content") or ""
            if not isinstance(content, str):
                content = " ".join(
                    part.get("text", "") for part in content if part.get("type") == "text"
                )
            ids.extend(self.tokenize(content))
            ids.append(EOS_ID)
        kwargs = template_kwargs or {}
        if kwargs.get("continue_final_message"):
            ids.pop()  # the last message stays open
        elif kwargs.get("add_generation_prompt", True):
            ids.append(ROLE_IDS["assistant"])
        return ids

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """One choice, or n side by side as n requests in the model (seeds seed, seed + 1,
        ...), their deltas interleaved as they come."""
        if request.sampling.n == 1:
            return self._generate_one(request)  # (no layer of its own per token)
        return self._generate_n(request)

    async def _generate_n(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        n = request.sampling.n
        seed = request.sampling.seed
        news: asyncio.Queue[TokenDelta | BaseException | None] = asyncio.Queue()

        async def run(index: int) -> None:
            choice = replace(
                request,
                request_id=f"{request.request_id}#{index}",
                sampling=replace(
                    request.sampling, n=1, seed=None if seed is None else seed + index
                ),
            )
            try:
                async for delta in self._generate_one(choice):
                    news.put_nowait(replace(delta, index=index))
                news.put_nowait(None)
            except Exception as exc:
                news.put_nowait(exc)

        tasks = [asyncio.create_task(run(index)) for index in range(n)]
        try:
            ended = 0
            while ended < n:
                item = await news.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    ended += 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate_one(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        await self.check_health()
        if self._task is None:
            raise EngineDeadError("the sim engine is not started")
        rid, sampling = request.request_id, request.sampling
        try:
            self._model.add(
                rid,
                request.prompt_token_ids,
                sampling.max_tokens,
                min_tokens=sampling.min_tokens,
                ignore_eos=sampling.ignore_eos,
                seed=sampling.seed,
                cache_salt=request.cache_salt,
                adapter=request.adapter,
            )
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from exc
        stream = self._streams[rid] = _Stream()
        self._wakeup.set()
        prompt_logprobs = (
            None
            if sampling.prompt_logprobs is None
            else [
                None,
                *(
                    self._prompt_logprob(t, sampling.prompt_logprobs, sampling.tokens_as_ids)
                    for t in request.prompt_token_ids[1:]
                ),
            ]
        )
        try:
            while True:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    raise stream.error
                token_ids, stream.token_ids = stream.token_ids, []
                finish = stream.finish_reason
                cached, stream.num_cached_tokens = stream.num_cached_tokens, None
                yield TokenDelta(
                    detokenize(token_ids),
                    token_ids,
                    finish_reason=finish,
                    num_cached_tokens=cached,
                    logprobs=None
                    if sampling.logprobs is None
                    else [
                        self._logprob(t, sampling.logprobs, sampling.tokens_as_ids)
                        for t in token_ids
                    ],
                    prompt_logprobs=prompt_logprobs,
                )
                prompt_logprobs = None  # on the first delta only
                if finish is not None:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            self._model.abort(rid)
            self._finishing.discard(rid)

    async def abort(self, request_id: str) -> None:
        """Abort in the engine; the request's stream ends with finish_reason "abort"."""
        self._model.abort(request_id)
        self._finishing.discard(request_id)
        stream = self._streams.get(request_id)
        if stream is not None and stream.finish_reason is None:
            stream.finish_reason = "abort"
            stream.ready.set()

    def num_unfinished_requests(self) -> int:
        return self._model.num_unfinished + len(self._finishing)

    def stats(self) -> EngineStats:
        model, stats = self._model, self._stats
        stats.running = model.num_running
        stats.waiting = model.num_waiting
        stats.kv_cache_usage = model.kv_blocks_in_use / self.config.kv_blocks
        stats.prefix_cache_queries = model.prefix_cache_queries
        stats.prefix_cache_hits = model.prefix_cache_hits
        if self.config.max_loras:
            stats.deferred = model.num_deferred
            stats.running_adapters = model.running_adapters
            stats.waiting_adapters = model.waiting_adapters
        return stats

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            catch_up = self.config.catch_up_steps
            due = loop.time()  # when the engine's next step begins, on its own clock
            in_a_row = 0  # steps run since this task last let the loop run others
            gate = self.gate
            while True:
                if not self._model.has_work:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    due = loop.time()
                    continue
                if gate.held:
                    await gate.opened()
                    due = loop.time()
                    continue  # (its requests may have been aborted meanwhile)
                now = loop.time()
                due = max(due, now - MAX_LAG_S) if catch_up else now
                paced = gate.begin()
                result = self._model.step()
                self._counted(result)
                self._finishing.update(
                    rid
                    for rid, reason in zip(result.request_ids, result.finish_reasons, strict=True)
                    if reason is not None
                )
                if paced:
                    due += result.duration_s
                wait = due - loop.time()
                if wait > 0 or in_a_row >= catch_up or result.duration_s <= 0:
                    await asyncio.sleep(max(0.0, wait))
                    in_a_row = 0
                else:  # its time passed while the loop ran others: the engine ran on
                    in_a_row += 1
                self._deliver(result)
        except Exception as exc:  # a bug in the model: the engine is dead, as a crash would be
            _log.exception("sim engine step failed")
            self._die(EngineDeadError(f"the sim engine failed: {exc!r}"))

    def _counted(self, result: StepResult) -> None:
        """A step's counts in `stats`: its tokens, its preemptions."""
        stats = self._stats
        tokens = result.prefill_tokens + result.decode_tokens
        if tokens:
            stats.count_step(tokens)
        if result.preempted:
            stats.preemptions += len(result.preempted)

    def _deliver(self, result: StepResult) -> None:
        cached = result.num_cached_tokens
        for rid, token, reason in zip(
            result.request_ids, result.token_ids, result.finish_reasons, strict=True
        ):
            self._finishing.discard(rid)
            stream = self._streams.get(rid)
            if stream is None or stream.finish_reason is not None:
                continue  # aborted while the step ran
            stream.token_ids.append(token)
            stream.finish_reason = reason
            if rid in cached:
                stream.num_cached_tokens = cached[rid]
            stream.ready.set()

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for rid, stream in list(self._streams.items()):
            self._model.abort(rid)
            if stream.error is None and stream.finish_reason is None:
                stream.error = EngineDeadError(str(error))
                stream.ready.set()
        self._finishing.clear()
