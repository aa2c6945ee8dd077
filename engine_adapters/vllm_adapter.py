"""The vLLM adapter: vLLM's v1 `AsyncLLM` (the class behind `AsyncLLMEngine`) behind EngineClient.

Engine arguments pass straight through to `AsyncEngineArgs`, so tensor/pipeline parallelism,
dtype, quantization and the rest are vLLM's own. Outputs are requested as deltas; closing or
cancelling `generate()` aborts the request inside the engine (vLLM's generate does that when
its generator is cancelled or closed; `abort()` is also exposed for explicit use).
"""

from __future__ import annotations

import asyncio
import binascii
import itertools
import json
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from engine_adapters.protocol import (
    AdapterLoadFailed,
    AdapterNotFound,
    EngineDeadError,
    EngineError,
    EngineLimits,
    EngineRequestError,
    EngineStats,
    EngineUnsupported,
    GenerationRequest,
    KVCacheInfo,
    ModelInfo,
    OutputPlan,
    OutputRequest,
    PromptEmbeds,
    PromptLogprob,
    SamplingOptions,
    TokenDelta,
    TokenLogprob,
    token_id_name,
)
from engine_adapters.vllm_output import ParserOptions, VLLMOutputPlanner

logger = logging.getLogger("sluice.engine.vllm")


def parse_engine_args(pairs: Sequence[str]) -> dict[str, Any]:
    """Turn ["max_model_len=1024", "enforce_eager=true"] into typed keyword arguments."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"engine argument {pair!r} is not KEY=VALUE")
        key = key.strip().lstrip("-").replace("-", "_")
        lowered = raw.strip().lower()
        value: Any
        if lowered in ("true", "false"):
            value = lowered == "true"
        elif lowered in ("none", "null"):
            value = None
        else:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = raw
        parsed[key] = value
    return parsed


def check_adapter(name: str, path: str, lora_config: Any) -> None:
    """What vLLM's worker checks of a LoRA adapter before loading it, with vLLM's own pieces:
    where it is (a local path, or a Hugging Face id it downloads), then its PEFT configuration
    (`adapter_config.json`) against the engine's LoRA configuration. AdapterNotFound where
    there is none, AdapterLoadFailed with vLLM's reason where vLLM would refuse it."""
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import get_adapter_absolute_path

    try:
        # (The position limit only scales a long-context adapter as it loads: none here.)
        adapter = PEFTHelper.from_local_dir(get_adapter_absolute_path(path), None)
    except FileNotFoundError:
        raise AdapterNotFound(
            str(LoRAAdapterNotFoundError(name, path)), param="lora_path"
        ) from None
    try:
        adapter.validate_legal(lora_config)
    except ValueError as exc:
        raise AdapterLoadFailed(f"vLLM refuses the adapter '{name}' at '{path}': {exc}") from None


def adapter_refused(name: str, path: str, exc: Exception) -> EngineError:
    """A start's adapter that vLLM does not load: the start stops, saying which and why."""
    return EngineError(f"LoRA adapter {name!r} at {path!r}: {exc}")


def to_sampling_params(options: SamplingOptions) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=options.n,
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        min_tokens=options.min_tokens,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        seed=options.seed,
        stop=list(options.stop),
        stop_token_ids=list(options.stop_token_ids),
        ignore_eos=options.ignore_eos,
        skip_special_tokens=options.skip_special_tokens,
        spaces_between_special_tokens=options.spaces_between_special_tokens,
        include_stop_str_in_output=options.include_stop_str_in_output,
        logit_bias=options.logit_bias,
        allowed_token_ids=None
        if options.allowed_token_ids is None
        else list(options.allowed_token_ids),
        bad_words=list(options.bad_words) or None,
        logprobs=options.logprobs,
        prompt_logprobs=options.prompt_logprobs,
        # From VLLMOutputPlanner: vLLM's own StructuredOutputsParams.
        structured_outputs=options.constraint,  # type: ignore[arg-type]
        output_kind=RequestOutputKind.DELTA,
    )


class ResumedText:
    """Text for the new tokens of a resumed generation, continuing its earlier tokens' text.

    vLLM's detokenizer primes itself on the prompt and, when the prompt ends inside text it
    cannot decode yet (a multi-byte character cut short, or a byte-level model's stray bytes),
    emits the primed prompt text with the first new token. A resumed generation's prompt ends
    with its own earlier output, so its text is decoded here instead: from the last character
    boundary, releasing text once it decodes cleanly, as vLLM's own detokenizer does.
    """

    SEARCH = 16  # how far back in the earlier tokens to look for a character boundary

    def __init__(
        self, tokenizer: Any, earlier: Sequence[int], *, skip_special_tokens: bool
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        start = 0
        for j in range(len(earlier) - 1, max(-1, len(earlier) - self.SEARCH), -1):
            if not self._decode(earlier[j:]).startswith("\ufffd"):
                start = j
                break
        self._pending = list(earlier[start:])  # tokens since the last clean boundary
        # Of their text, the client has everything but a character still incomplete.
        self._sent = len(self._decode(self._pending).rstrip("\ufffd"))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def add(self, token_ids: Sequence[int], *, finished: bool = False) -> str:
        """The text the new tokens add; at the end, whatever is left, decodable or not."""
        self._pending.extend(token_ids)
        text = self._decode(self._pending)
        if text.endswith("\ufffd") and not finished:
            return ""  # wait for the rest of the character
        new, self._pending, self._sent = text[self._sent :], [], 0
        return new


class VLLMEngine:
    """EngineClient over vLLM's AsyncLLM, running in this process (core in a subprocess)."""

    def __init__(
        self,
        model: str,
        served_model_name: str,
        engine_args: dict[str, Any] | None = None,
        parsers: ParserOptions | None = None,
        adapters: Mapping[str, str] | None = None,
        adapter_room: int = 0,
        adapter_slots: int = 0,
    ) -> None:
        """`adapters`: LoRA adapters served as models, name to path; `adapter_room`: the most
        adapters served at once, these and those loaded at runtime; `adapter_slots`: the most
        distinct adapters one step runs, as the scheduler plans (default: the room). The
        engine's arguments must enable LoRA for them: `enable_lora`, a `max_loras` of at least
        the room, and a `max_lora_rank` that holds them."""
        self._model_path = model
        self._served_name = served_model_name
        self._engine_args = dict(engine_args or {})
        self._parsers = parsers or ParserOptions()
        self._adapters = dict(adapters or {})  # served now: name -> path
        self._adapter_room = max(adapter_room, len(self._adapters))
        self._adapter_slots = min(adapter_slots or self._adapter_room, self._adapter_room)
        # Those in vLLM (at most the room), least recently used first: name -> its LoRARequest.
        self._loras: OrderedDict[str, Any] = OrderedDict()
        self._lora_ids = itertools.count(1)
        self._using: Counter[str] = Counter()  # engine requests running on each adapter
        self._unloading: set[str] = set()  # unloaded, waiting for those requests to end
        self._loading = asyncio.Lock()  # one load or unload at a time: each checks, then awaits
        self._llm: Any = None
        self._tokenizer: Any = None
        self._planner: VLLMOutputPlanner | None = None
        self._info: ModelInfo | None = None  # known once the engine has started
        self._stats = EngineStats()  # kept by vLLM's steps (`engine_stats_logger`)

    @property
    def model(self) -> ModelInfo:
        if self._info is None:
            raise EngineError("the vLLM engine has not started")
        return self._info

    async def start(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.envs import enable_envs_cache
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from engine_adapters.vllm_stats import engine_stats_logger

        # vLLM's own stat loggers off (its log line, its Prometheus series): with a logger of
        # ours, vLLM computes each step's stats for it alone (docs/observability.md).
        args = AsyncEngineArgs(
            model=self._model_path,
            served_model_name=[self._served_name],
            disable_log_stats=True,
            **self._engine_args,
        )
        # As `AsyncLLM.from_engine_args` makes it, with the start's adapters checked in between.
        engine_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        self._check_adapters(engine_config.lora_config)
        self._llm = AsyncLLM.from_vllm_config(
            engine_config,
            usage_context=UsageContext.ENGINE_CONTEXT,
            stat_loggers=[engine_stats_logger(self._stats)],
            disable_log_stats=True,
        )
        # Those stats read an environment variable of vLLM's for each output token (most of
        # what they cost): cached from now on, as vLLM's engine core caches them in its own
        # processes once they have started. Nothing here sets vLLM's variables later.
        enable_envs_cache()
        config = self._llm.vllm_config
        cache = config.cache_config
        if not cache.num_gpu_blocks:
            raise EngineError("vLLM started without reporting its KV cache size")
        scheduler = config.scheduler_config
        self._info = ModelInfo(
            name=self._served_name,
            path=self._model_path,
            max_model_len=config.model_config.max_model_len,
            limits=EngineLimits(
                max_num_seqs=scheduler.max_num_seqs,
                max_batched_tokens=scheduler.max_num_batched_tokens,
                kv_cache=KVCacheInfo(block_size=cache.block_size, num_blocks=cache.num_gpu_blocks),
                adapter_slots=self._adapter_slots,
            ),
            vocab_size=config.model_config.get_vocab_size(),
            adapters=MappingProxyType(self._adapters),
        )
        await self._load_adapters()
        self._tokenizer = self._llm.get_tokenizer()
        self._planner = VLLMOutputPlanner(self._parsers, self._tokenizer, config)
        await self._warm_up()
        logger.info("vLLM engine up: %s", self._info)

    def _check_adapters(self, lora_config: Any) -> None:
        """Each adapter of the start checked as vLLM's worker checks one before it loads it,
        before the engine's processes start: a missing adapter, or one vLLM would refuse (a
        rank above `max_lora_rank`, DoRA, a bias), stops the start in seconds, not once the
        engine is up (half a minute and more of CPU)."""
        for name, path in self._adapters.items():
            try:
                check_adapter(name, path, lora_config)
            except Exception as exc:
                raise adapter_refused(name, path, exc) from exc

    async def _load_adapters(self) -> None:
        """Each adapter loaded now, as vLLM's server loads its `--lora-modules`: a bad one
        stops the start with vLLM's reason, not a user's first request."""
        for name, path in list(self._adapters.items()):
            try:
                await self._make_room()
                await self._add_lora(name, path)
            except Exception as exc:
                raise adapter_refused(name, path, exc) from exc

    async def _add_lora(self, name: str, path: str) -> None:
        """Into vLLM (there must be room): AdapterNotFound where vLLM finds none at `path`,
        AdapterLoadFailed with vLLM's reason where it cannot load the one there."""
        from vllm.exceptions import LoRAAdapterNotFoundError
        from vllm.lora.request import LoRARequest

        lora = LoRARequest(name, next(self._lora_ids), path, base_model_name=self._served_name)
        try:
            await self._llm.add_lora(lora)
        except Exception as exc:  # (from the engine's process: matched by its text, as vLLM's)
            missing = str(LoRAAdapterNotFoundError(name, path))
            if missing in str(exc):
                raise AdapterNotFound(missing, param="lora_path") from None
            raise AdapterLoadFailed(
                f"loading the adapter '{name}' from '{path}' failed: {exc}"
            ) from exc
        self._loras[name] = lora

    async def _make_room(self) -> None:
        """Room in vLLM for one adapter more: the least recently used one that runs nothing
        leaves it (still served: it comes back when a request needs it)."""
        while len(self._loras) >= self._adapter_room:
            idle = next((name for name in self._loras if not self._using[name]), None)
            if idle is None:
                raise EngineRequestError(
                    f"every one of the {len(self._loras)} adapters held (--max-cpu-loras) runs "
                    "now; retry once one is idle",
                    param="lora_name",
                )
            await self._remove_lora(idle)

    async def load_adapter(self, name: str, path: str) -> None:
        async with self._loading:
            await self._load_adapter(name, path)

    async def _load_adapter(self, name: str, path: str) -> None:
        if self._llm is None or self._llm.errored:
            raise EngineDeadError("vLLM engine is not running")
        if name == self._served_name or name in self._adapters or name in self._unloading:
            raise EngineRequestError(f"the adapter '{name}' is already loaded", param="lora_name")
        if not self._adapter_room:
            raise EngineUnsupported(
                "this server serves no LoRA adapters: start it with --enable-lora",
                param="lora_name",
            )
        await self._make_room()
        await self._add_lora(name, path)  # (checked by vLLM, and ready for its first request)
        self._adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        async with self._loading:
            if self._adapters.pop(name, None) is None:
                raise EngineRequestError(f"the adapter '{name}' is not loaded", param="lora_name")
            self._unloading.add(name)
            if not self._using[name]:
                await self._remove_lora(name)

    async def _remove_lora(self, name: str) -> None:
        self._unloading.discard(name)
        lora = self._loras.pop(name, None)
        if lora is not None and self._llm is not None and not self._llm.errored:
            await self._llm.remove_lora(lora.lora_int_id)

    async def _warm_up(self) -> None:
        """vLLM sets up logprobs on the first request that asks for them (about 150 ms here on
        CPU): one token with logprobs now, so no user's first token pays for it."""
        request = GenerationRequest(
            "sluice-warm-up", self.tokenize("warm up"), SamplingOptions(max_tokens=1, logprobs=0)
        )
        async for _ in self.generate(request):
            pass

    async def stop(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def is_healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    async def check_health(self) -> None:
        if self._llm is None:
            raise EngineDeadError("engine not started")
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineDeadError(f"vLLM engine is dead: {exc!r}") from exc

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids)))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            list(messages),
            tools=None if tools is None else list(tools),
            tokenize=False,
            **{"add_generation_prompt": True, **(template_kwargs or {})},
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def plan_output(self, request: OutputRequest) -> OutputPlan:
        if self._planner is None:
            raise EngineDeadError("engine not started")
        return self._planner.plan(request)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        if self._llm is None or self._llm.errored:
            raise EngineDeadError("vLLM engine is not running")
        adapter, lora = request.adapter, await self._lora(request)
        prompt: dict[str, Any] = (
            {"prompt_token_ids": list(request.prompt_token_ids)}
            if request.prompt_embeds is None
            else {"prompt_embeds": request.prompt_embeds.value}
        )
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        stream = (
            self._beam_search(request, lora)
            if request.sampling.beam_search
            else (
                self._llm.generate(
                    prompt,
                    to_sampling_params(request.sampling),
                    request.request_id,
                    lora_request=lora,
                )
            )
        )
        first = True
        resumed = None
        if request.resumed_tokens:
            resumed = ResumedText(
                self._tokenizer,
                request.prompt_token_ids[-request.resumed_tokens :],
                skip_special_tokens=request.sampling.skip_special_tokens,
            )
        # Counted where the `finally` that uncounts it begins, and with no await since `_lora`:
        # the adapter cannot leave vLLM meanwhile, and a request refused above (vLLM's own
        # checks of its parameters) leaves no count behind that would keep it in for ever.
        if adapter is not None:
            self._using[adapter] += 1
        try:
            async for out in stream:
                for completion in out.outputs:  # the choices with news (n > 1: several)
                    text = completion.text
                    if resumed is not None:
                        text = resumed.add(completion.token_ids, finished=out.finished)
                        stop = completion.stop_reason
                        if (
                            isinstance(stop, str)
                            and stop in text
                            and not request.sampling.include_stop_str_in_output
                        ):
                            text = text[: text.index(stop)]  # vLLM cuts its own text there too
                    yield TokenDelta(
                        text=text,
                        token_ids=completion.token_ids,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        num_cached_tokens=out.num_cached_tokens if first else None,
                        logprobs=None
                        if request.sampling.logprobs is None
                        else self._logprobs(
                            completion.token_ids, completion.logprobs, request.sampling
                        ),
                        index=completion.index,
                        prompt_logprobs=self._prompt_logprobs(out.prompt_logprobs, request.sampling)
                        if first and request.sampling.prompt_logprobs is not None
                        else None,
                    )
                    first = False
        except VLLMEngineDead as exc:
            raise EngineDeadError("vLLM engine died") from exc
        except (ValueError, VLLMClientError) as exc:  # vLLM's request validation
            raise EngineRequestError(str(exc)) from exc
        except EngineError:
            raise
        except Exception as exc:
            if self._llm is None or self._llm.errored:
                raise EngineDeadError("vLLM engine died") from exc
            raise EngineError(f"vLLM generate failed: {exc!r}") from exc
        finally:
            # Closing vLLM's generator aborts the request if it has not finished.
            await stream.aclose()
            if adapter is not None:
                self._using[adapter] -= 1
                if not self._using[adapter] and adapter in self._unloading:
                    await self._remove_lora(adapter)

    def _beam_search(self, request: GenerationRequest, lora: Any) -> AsyncGenerator[Any, None]:
        """vLLM's own online beam search (what its server runs for `use_beam_search`): one
        engine request per beam and step, one RequestOutput with the n best at the end.
        Cancelling it cancels the step's engine requests, which aborts them."""
        from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
        from vllm.inputs import tokens_input
        from vllm.sampling_params import BeamSearchParams

        class Search(BeamSearchOnlineMixin):
            renderer, engine_client = self._llm.renderer, self._llm

        s = request.sampling
        params = BeamSearchParams(
            beam_width=s.n,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            temperature=s.temperature,
            length_penalty=s.length_penalty,
            include_stop_str_in_output=s.include_stop_str_in_output,
            skip_special_tokens=s.skip_special_tokens,
        )
        return Search().beam_search(
            tokens_input(list(request.prompt_token_ids), cache_salt=request.cache_salt),
            request.request_id,
            params,
            lora_request=lora,
        )

    async def _lora(self, request: GenerationRequest) -> Any:
        """The request's adapter as vLLM names it (None: the base model), brought back into
        vLLM if it left to make room (`_make_room`); EngineRequestError if it is no longer
        served (a preempted request resumed after its adapter was unloaded)."""
        name = request.adapter
        if name is None:
            return None
        lora = self._loras.get(name)
        if lora is not None:
            self._loras.move_to_end(name)
            return lora
        async with self._loading:
            if name not in self._loras:
                path = self._adapters.get(name)
                if path is None:
                    raise EngineRequestError(f"the adapter '{name}' was unloaded", param="model")
                await self._make_room()
                await self._add_lora(name, path)
            return self._loras[name]

    def load_prompt_embeds(self, data: str) -> PromptEmbeds:
        """vLLM's own loader, with its checks (base64, a tensor saved with weights only, the
        model's hidden size), then its shape rule: (positions, hidden size), a batch of one
        squeezed."""
        from vllm.exceptions import VLLMClientError
        from vllm.renderers.embed_utils import safe_load_prompt_embeds

        if self._llm is None:
            raise EngineDeadError("engine not started")
        config = self._llm.vllm_config.model_config
        if not config.enable_prompt_embeds:
            raise EngineUnsupported(
                "this server takes no 'prompt_embeds': start it with --engine-arg "
                "enable_prompt_embeds=true",
                param="prompt_embeds",
            )
        try:
            tensor = safe_load_prompt_embeds(config, data.encode("ascii", "replace"))
        except binascii.Error as exc:
            raise EngineRequestError(
                f"'prompt_embeds' is not base64: {exc}", param="prompt_embeds"
            ) from None
        except (ValueError, VLLMClientError) as exc:  # vLLM's name the parameter
            raise EngineRequestError(str(exc), param="prompt_embeds") from None
        if tensor.ndim == 3 and tensor.shape[0] == 1:
            tensor = tensor.squeeze(0)
        if tensor.ndim != 2 or tensor.shape[0] == 0:
            raise EngineRequestError(
                "'prompt_embeds' must have the shape (positions, hidden size), got "
                f"{tuple(tensor.shape)}",
                param="prompt_embeds",
            )
        return PromptEmbeds(length=int(tensor.shape[0]), value=tensor)

    def _logprobs(
        self, token_ids: Sequence[int], positions: Any, sampling: SamplingOptions
    ) -> list[TokenLogprob]:
        """vLLM's per-position {token id: Logprob} (the sampled token and the k best, ranked)
        as engine-neutral entries."""
        k, as_ids = sampling.logprobs or 0, sampling.tokens_as_ids
        entries = []
        for token_id, candidates in zip(token_ids, positions or (), strict=False):
            ranked = sorted(
                (c for c in candidates.items() if c[1].rank is not None and c[1].rank <= k),
                key=lambda c: c[1].rank,
            )[:k]
            entries.append(
                TokenLogprob(
                    token=self._token_text(token_id, candidates[token_id], as_ids),
                    logprob=max(candidates[token_id].logprob, -9999.0),
                    top=tuple(
                        (self._token_text(t, lp, as_ids), max(lp.logprob, -9999.0))
                        for t, lp in ranked
                    ),
                )
            )
        return entries

    def _prompt_logprobs(
        self, positions: Any, sampling: SamplingOptions
    ) -> list[list[PromptLogprob] | None]:
        """vLLM's per-position {token id: Logprob} as engine-neutral entries, likeliest
        first (the prompt's own token, whatever its rank, among them)."""
        return [
            None
            if candidates is None
            else sorted(
                (
                    PromptLogprob(
                        token_id,
                        self._token_text(token_id, lp, sampling.tokens_as_ids),
                        max(lp.logprob, -9999.0),
                        lp.rank,
                    )
                    for token_id, lp in candidates.items()
                ),
                key=lambda p: p.rank,
            )
            for candidates in positions or ()
        ]

    def _token_text(self, token_id: int, logprob: Any, as_id: bool) -> str:
        if as_id:
            return token_id_name(token_id)
        if logprob.decoded_token is not None:
            return str(logprob.decoded_token)
        return str(self._tokenizer.decode([token_id]))

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def num_unfinished_requests(self) -> int:
        if self._llm is None:
            return 0
        return int(self._llm.get_num_unfinished_requests())

    def stats(self) -> EngineStats:
        return self._stats
