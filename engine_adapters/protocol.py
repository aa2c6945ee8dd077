"""The one interface the server depends on: an engine that streams token deltas.

`server/` imports this module and never an engine library. Each adapter (vLLM, the
continuous-batching model `sim`, the fixed-batch model `sim-batch`) implements `EngineClient`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable


class EngineError(Exception):
    """The engine failed while serving a request (or as a whole)."""


class EngineDeadError(EngineError):
    """The engine is gone: every in-flight and future request fails until a restart."""


class EngineRequestError(EngineError):
    """The engine refused one request (bad parameters it alone could check); `param` names the
    request field at fault when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineUnsupported(EngineRequestError):
    """A well-formed request asks for something this engine cannot do."""


class AdapterNotFound(EngineRequestError):
    """No LoRA adapter where a load was asked to find one."""


class AdapterLoadFailed(EngineError):
    """The LoRA adapter at a path could not be loaded (its files, its rank...): vLLM's server
    answers it as its own failure (500), with the reason."""


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Engine-neutral sampling parameters; adapters convert them to their engine's form."""

    max_tokens: int  # per choice
    n: int = 1  # choices: independent samples of the same prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # in the text of special tokens not skipped
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated
    bad_words: tuple[str, ...] = ()  # never generated
    logprobs: int | None = None  # None: none; k: each token's and the k most likely ones'
    prompt_logprobs: int | None = None  # the same for each prompt token (on the first delta)
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", not by their text.
    tokens_as_ids: bool = False
    # What the output must match (a JSON schema, a grammar...), in the engine's own form: from
    # `EngineClient.plan_output`, carried by the server without looking inside.
    constraint: object | None = None
    # Beam search (vLLM's `use_beam_search`): the n best of n beams, answered when all are done,
    # each beam scored by its cumulative log-probability over its length ** length_penalty.
    # Only max_tokens, n, temperature, ignore_eos, include_stop_str_in_output and
    # skip_special_tokens apply then (the server refuses the rest).
    beam_search: bool = False
    length_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's text and log-probability, and the `logprobs` most likely tokens at
    its position as (text, log-probability), best first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def token_id_name(token_id: int) -> str:
    """A token as logprobs name it with `tokens_as_ids` (vLLM's format)."""
    return f"token_id:{token_id}"


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A candidate token at a prompt position: its id, text, log-probability and rank (1: the
    likeliest)."""

    token_id: int
    token: str
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """A prompt given as embeddings (vLLM's `prompt_embeds`): `length` positions, in the
    engine's own form (`value`, from `EngineClient.load_prompt_embeds`)."""

    length: int
    value: object


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation, prompt already tokenized by the engine's own tokenizer (or given as
    `prompt_embeds`, with no token ids).

    `resumed_tokens > 0` marks a resumed generation (one that was preempted): the last
    `resumed_tokens` prompt tokens are its own earlier output, and the text of its deltas
    continues the text those tokens spelled, as if it had never stopped.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingOptions
    resumed_tokens: int = 0
    prompt_embeds: PromptEmbeds | None = None
    adapter: str | None = None  # the LoRA adapter that generates it (one of `ModelInfo.adapters`)
    # Prefix-cache blocks are shared only among requests with the same salt (vLLM's).
    cache_salt: str | None = None

    @property
    def prompt_length(self) -> int:
        if self.prompt_embeds is not None:
            return self.prompt_embeds.length
        return len(self.prompt_token_ids)

    def continued(self, generated: Sequence[int], request_id: str) -> GenerationRequest:
        """The request that continues this one after it generated `generated` (its
        `resumed_tokens` counting those of every earlier continuation too)."""
        sampling = replace(
            self.sampling,
            max_tokens=self.sampling.max_tokens - len(generated),
            min_tokens=max(0, self.sampling.min_tokens - len(generated)),
            prompt_logprobs=None,  # the client has the prompt's; this prompt is longer
        )
        return GenerationRequest(
            request_id=request_id,
            prompt_token_ids=[*self.prompt_token_ids, *generated],
            sampling=sampling,
            resumed_tokens=self.resumed_tokens + len(generated),
            adapter=self.adapter,
            cache_salt=self.cache_salt,
        )


@dataclass(slots=True)
class TokenDelta:
    """New output since the previous delta of the same request. Not changed once made (not
    frozen: one is made per token, and a frozen dataclass's `__init__` costs four times a
    plain one's).

    `token_ids` may hold several tokens when the consumer fell behind the engine; `text` is
    their detokenized text (possibly empty while a multi-byte character is incomplete).
    `index` is the choice it belongs to (0 to n - 1); `finish_reason` is set on the last delta
    of its choice only: "stop", "length" or "abort".
    `num_cached_tokens`, on the first delta, is how many prompt tokens the engine found in its
    prefix cache (None when it does not say). `logprobs`, when the request asked for them,
    has one entry per token id. `prompt_logprobs`, on the first delta when asked: per prompt
    position, its token and the k likeliest (None at the first position, which has no
    context).
    """

    text: str
    token_ids: Sequence[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int | None = None
    logprobs: Sequence[TokenLogprob] | None = None
    index: int = 0
    prompt_logprobs: Sequence[Sequence[PromptLogprob] | None] | None = None

    def followed_by(self, later: TokenDelta) -> TokenDelta:
        """One delta with this one's output and then `later`'s (of the same choice)."""
        return TokenDelta(
            self.text + later.text,
            [*self.token_ids, *later.token_ids],
            later.finish_reason,
            later.stop_reason,
            later.num_cached_tokens if self.num_cached_tokens is None else self.num_cached_tokens,
            None if self.logprobs is None else [*self.logprobs, *(later.logprobs or ())],
            self.index,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )


@dataclass(frozen=True, slots=True)
class KVCacheInfo:
    """The engine's KV cache: `num_blocks` blocks of `block_size` tokens."""

    block_size: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What the scheduler plans with, as the engine itself enforces it: `max_num_seqs` seats
    (the most sequences it runs in one step), `max_batched_tokens` (the most tokens one step
    computes, prompt chunks and decodes together), its KV cache, and `adapter_slots` (the most
    distinct LoRA adapters one step runs; 0: it serves none). A request dispatched past these
    only waits inside the engine, where Sluice cannot order it. Every field is required: an
    engine that forgot one would silently look unbounded."""

    max_num_seqs: int
    max_batched_tokens: int
    kv_cache: KVCacheInfo
    adapter_slots: int

    def __post_init__(self) -> None:
        values = (self.max_num_seqs, self.max_batched_tokens, *astuple(self.kv_cache))
        if min(values) < 1 or self.adapter_slots < 0:
            raise ValueError(f"engine limits must all be >= 1 (adapter slots >= 0): {self}")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine serves and what it can hold, known once it has started.

    `path`: where the weights come from (the models list's `root`; a simulated engine gives its
    name). `limits`: what the scheduler plans with. `vocab_size` 0: the engine does not say, so
    token ids reach it unchecked. `engine` names the engine in errors; `logprobs`: whether it
    can return them; `choices`: whether it can sample n > 1 choices of one prompt;
    `beam_search`: whether it can search beams. `adapters`: the LoRA adapters it serves as
    models of their own, by name, with the path each was loaded from."""

    name: str
    path: str
    max_model_len: int
    limits: EngineLimits
    vocab_size: int = 0
    engine: str = "vllm"
    logprobs: bool = True
    choices: bool = True
    beam_search: bool = True
    adapters: Mapping[str, str] = field(default_factory=dict)


# The bounds a step's tokens are counted into (`EngineStats.step_tokens`): vLLM's own, for its
# `vllm:iteration_tokens_total` histogram.
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class EngineStats:
    """What an engine's own scheduler knows, as of its last step: its adapter keeps it (counts
    only grow), and the server reads it when Prometheus scrapes (`EngineClient.stats`), so
    nothing is recorded per token. Sequences, not requests: n choices are n."""

    running: int = 0  # in its running batch
    waiting: int = 0  # waiting inside it for room
    deferred: int = 0  # of those waiting, passed over for a while (a LoRA adapter's slot)
    kv_cache_usage: float = 0.0  # the share of its KV cache's blocks in use, 0 to 1
    prefix_cache_queries: int = 0  # prompt tokens of new sequences looked up in its prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found there
    preemptions: int = 0  # sequences it stopped for room, to compute again later
    # Its steps, by the tokens each computed (prompt and generated), per bound of
    # STEP_TOKEN_BOUNDS and one more above them all (not cumulative); and their tokens' sum.
    step_tokens: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BOUNDS) + 1))
    step_tokens_sum: int = 0
    running_adapters: tuple[str, ...] = ()  # the LoRA adapters of its running sequences
    waiting_adapters: tuple[str, ...] = ()  # and of its waiting ones

    def count_step(self, tokens: int) -> None:
        """A step that computed `tokens` tokens."""
        self.step_tokens[bisect_left(STEP_TOKEN_BOUNDS, tokens)] += 1
        self.step_tokens_sum += tokens


@dataclass(frozen=True, slots=True)
class OutputRequest:
    """How the client wants a generation's output shaped, in the request's own OpenAI/vLLM
    fields (`response_format`, vLLM's `structured_outputs`; on chat also `tools`,
    `tool_choice`, `parallel_tool_calls`, `include_reasoning`), for `kind` "chat" (with its
    `messages`) or "completion". Empty `fields`: plain text, as the engine would give it."""

    kind: str
    fields: Mapping[str, Any]
    messages: Sequence[dict[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None  # the chat template's (a parser's too)


class OutputParser(Protocol):
    """Reads one chat choice's generated text into OpenAI message fields (`content`,
    `reasoning`, `tool_calls`), as the engine's tool and reasoning parsers understand it.
    Stateful: one per choice."""

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        """A stream chunk's `delta` for new text; None while nothing can be sent yet."""
        ...

    def message(self, text: str, token_ids: Sequence[int]) -> dict[str, Any]:
        """The whole message's fields for the whole text."""
        ...

    def finish_reason(self, reason: str, called_tools: bool) -> str:
        """The choice's finish_reason ("tool_calls" where OpenAI says so) for the engine's."""
        ...


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """The engine's answer to an OutputRequest: the `constraint` for SamplingOptions, the
    `tools` to show the chat template, and a maker of parsers for the output, given the prompt
    token ids (None: the text is the content)."""

    constraint: object | None = None
    tools: Sequence[dict[str, Any]] | None = None
    parser: Callable[[Sequence[int]], OutputParser] | None = None


PLAIN_TEXT = OutputPlan()


def no_adapters(engine: str) -> EngineUnsupported:
    """The refusal of an engine that serves no LoRA adapters."""
    return EngineUnsupported(f"the {engine} engine serves no LoRA adapters", param="lora_name")


def no_prompt_embeds(engine: str) -> EngineUnsupported:
    """The refusal of an engine that only takes token prompts."""
    return EngineUnsupported(
        f"the {engine} engine does not take 'prompt_embeds'", param="prompt_embeds"
    )


def plain_text_only(request: OutputRequest, engine: str) -> OutputPlan:
    """The plan of an engine that only generates free text: tools are shown to the template
    only with `tool_choice` "none"; anything else is refused naming the engine."""
    fields = request.fields
    for key, value in fields.items():
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if key in ("tools", "parallel_tool_calls", "include_reasoning") or (
            key == "tool_choice" and value == "none"
        ):
            continue
        raise EngineUnsupported(f"the {engine} engine does not support '{key}'", param=key)
    if fields.get("tools") and fields.get("tool_choice") != "none":
        raise EngineUnsupported(
            f"the {engine} engine does not call tools; send 'tool_choice': 'none' with 'tools'",
            param="tools",
        )
    return OutputPlan(tools=fields.get("tools"))


@runtime_checkable
class EngineClient(Protocol):
    """What the server needs from an engine, and nothing more."""

    @property
    def model(self) -> ModelInfo:
        """The model and the engine's limits; an engine that learns them as it starts (vLLM)
        raises EngineError before start()."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def check_health(self) -> None:
        """Return if healthy; raise EngineDeadError if the engine is gone."""
        ...

    @property
    def is_healthy(self) -> bool: ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Prompt token ids for raw text, with the engine's own tokenizer (and its BOS, say,
        when `add_special_tokens`)."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids; each id is below `model.vocab_size` when that is known."""
        ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token id's own string in the tokenizer's vocabulary (e.g. 'Ġword')."""
        ...

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids for chat messages (and the tools on offer), through the model's
        chat template, given `template_kwargs` as extra variables (vLLM's
        `chat_template_kwargs`: `enable_thinking`, say; a template ignores what it does not
        use)."""
        ...

    def plan_output(self, request: OutputRequest) -> OutputPlan:
        """How this engine shapes the output a request asks for; EngineRequestError (a 400)
        for what it cannot do or what is malformed. Cheap: called before queueing."""
        ...

    def load_prompt_embeds(self, data: str) -> PromptEmbeds:
        """A prompt's embeddings from a client's base64 text (vLLM's `prompt_embeds`: a
        tensor saved by `torch.save`); EngineUnsupported where the engine takes none,
        EngineRequestError for malformed ones. Synchronous: called before queueing."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Stream deltas. Closing or cancelling the iterator aborts the engine request."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` as the model `name` (in `model.adapters` once
        loaded); EngineRequestError that says why it cannot (EngineUnsupported: this engine
        serves no adapters)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter `name` (one of `model.adapters`): it leaves `model.adapters`
        at once, and the engine once the requests that run on it have ended."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def num_unfinished_requests(self) -> int:
        """Requests the engine still holds (running or waiting inside it)."""
        ...

    def stats(self) -> EngineStats:
        """Its scheduler's state and counts as of its last step. Cheap (read at each scrape);
        read it at once: the engine may go on updating the object it returns."""
        ...
