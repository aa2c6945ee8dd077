"""The fields chat and text completions share: OpenAI's, and the sampling parameters vLLM's
server adds (`top_k`, `min_p`, `min_tokens`, `ignore_eos`, `repetition_penalty`,
`stop_token_ids`, ...), so clients written for vLLM work unchanged. A field vLLM's server
declares and Sluice cannot honour is ignored where it changes nothing (`NoEffect`, or
`OnlyDefault` at its default) and refused with 400 `unsupported_parameter` where it would
change the answer; an undeclared field is ignored, as vLLM's server ignores it."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from server.core.errors import InvalidRequest, UnsupportedParameter
from server.openai_wire.wire import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    NoEffect,
    Number,
    OnlyDefault,
    TokenId,
    WireModel,
)

Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[Number, Field(ge=-2, le=2)]
# The sampling options vLLM's beam search applies; any other is refused with it (it would
# drop them).
_WITH_BEAM = ("temperature", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "n")
# Read as they are into the sampling options (numbers as floats, lists as tuples).
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "bad_words",
)
# Why a field changes nothing here, or cannot be served (docs/request-models.md's table).
TEXT_ONLY = "multimodal input only: Sluice takes text content"
NO_CONNECTOR = "connector, which this server does not run"


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: the usage so far in every chunk (with include_usage)"
    )


class KvTransferParams(WireModel):
    """vLLM's `kv_transfer_params`: only its `prompt_token_ids` (Sluice runs no KV connector,
    so any other key would be ignored: it is refused instead)."""

    model_config = ConfigDict(extra="forbid")
    unknown_field: ClassVar[str] = "'kv_transfer_params.{key}' needs a KV " + NO_CONNECTOR

    prompt_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="a prefill stage's prompt, used verbatim"
    )


class VllmFields(WireModel):
    """Fields vLLM's server declares on its chat, completion and Responses requests alike,
    that Sluice does not plainly honour (docs/request-models.md)."""

    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        None,
        description="vLLM's: a prefix cache of its own for the requests with this salt "
        "(within the tenant's)",
    )
    session_id: Annotated[str | None, NoEffect("a hint that requests belong together")] = None
    mm_payload: Annotated[Literal["tensors", "none"] | None, NoEffect(TEXT_ONLY)] = None
    return_mm_kwargs: Annotated[bool | None, NoEffect(TEXT_ONLY)] = None
    vllm_xargs: Annotated[
        dict[str, Any] | None, NoEffect("read by vLLM's extensions only; Sluice loads none")
    ] = None
    priority: Annotated[
        Any, OnlyDefault(0, why="Sluice orders requests by traffic class: send service_tier")
    ] = None
    watermarking: Annotated[Any, OnlyDefault(False)] = None
    ec_transfer_params: Annotated[
        Any, OnlyDefault({}, why="needs an encoder-cache " + NO_CONNECTOR)
    ] = None


class SamplingFields(WireModel):
    """The sampling parameters a chat, a completion and a response (`POST /v1/responses`,
    as vLLM's server takes it) share. `None` is a field not sent."""

    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[Number, Field(gt=0, le=10)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^\s*[0-9]+\s*$")], Number] | None = Field(
        None, description="token id: bias, clamped to [-100, 100]"
    )

    def sampling_fields(self) -> dict[str, Any]:
        """The ones this body sets, as JSON has them (for the chat request a response is)."""
        return self.model_dump(include=set(SamplingFields.model_fields), exclude_none=True)


class GenerationBody(SamplingFields, VllmFields):
    """A chat or text completion's fields, both kinds'. `None` is a field not sent."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="at least 1 (0 with a completion's echo: the prompt alone)"
    )
    # Sampling (and `SamplingFields`').
    spaces_between_special_tokens: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    allowed_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="vLLM's: only these tokens may be generated"
    )
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, description="vLLM's: words never generated"
    )
    prompt_logprobs: Logprobs | None = Field(
        None, description="vLLM's: each prompt token's and the k likeliest (not with `stream`)"
    )
    return_tokens_as_token_ids: bool | None = Field(
        None, description="vLLM's: logprobs name tokens 'token_id:N'"
    )
    use_beam_search: bool | None = Field(
        None,
        description="vLLM's: the n best of n beams, answered when all are done "
        "(completions: not with `stream`)",
    )
    length_penalty: Annotated[Number, Field(ge=-1e9, le=1e9)] | None = Field(
        None,
        description="vLLM's: with beam search, a beam's score is its log-probability over "
        "its length ** length_penalty",
    )
    # The prompt and the answer's shape.
    add_special_tokens: bool | None = None
    return_token_ids: bool | None = None
    echo: bool | None = Field(
        None,
        description="completions: the prompt first; chat: the last message's content first, "
        "if the assistant's",
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    kv_transfer_params: KvTransferParams | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="vLLM's: tokens per streamed chunk, raising the server's --stream-interval "
        "for this request; a choice's first and last chunks are sent at once",
    )
    # How the output is shaped: the engine's to apply (see EngineClient.plan_output).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: one of json, regex, choice, grammar, json_object, structural_tag",
    )
    no_stop_trim: bool | None = Field(
        None, description="SGLang's name for include_stop_str_in_output (either keeps it)"
    )
    # Accepted at their defaults only (another value is a 400 unsupported_parameter).
    best_of: Annotated[Any, OnlyDefault(1)] = None
    functions: Annotated[Any, OnlyDefault([])] = None
    function_call: Annotated[Any, OnlyDefault("none", "auto")] = None
    suffix: Annotated[Any, OnlyDefault("")] = None
    thinking_token_budget: Annotated[Any, OnlyDefault(None)] = None
    logprob_token_ids: Annotated[Any, OnlyDefault([])] = None
    repetition_detection: Annotated[Any, OnlyDefault(None)] = None
    return_hidden_states: Annotated[Any, OnlyDefault(False)] = Field(
        None, description="SGLang's (sent by vLLM's router)"
    )
    # Accepted, with no effect on the answer.
    user: Annotated[str | None, NoEffect("metadata")] = None
    metadata: Annotated[dict[str, Any] | None, NoEffect("metadata")] = None
    store: Annotated[bool | None, NoEffect("completions are not stored")] = None
    request_id: Annotated[
        str | None, NoEffect("the response is named by X-Request-Id or by Sluice")
    ] = None
    routed_experts_prompt_start: Annotated[
        int | None, NoEffect("only with routed experts returned, which Sluice does not")
    ] = None
    return_token_offsets: Annotated[
        bool | None, NoEffect("the render endpoints' (which answer null offsets)")
    ] = None

    # The output-shaping fields of this kind (each the engine's to apply).
    output_fields: ClassVar[tuple[str, ...]] = ("response_format", "structured_outputs")

    def _sampling(self, logprobs: int | None) -> dict[str, Any]:
        """The sampling options' values this body sets."""
        sampling: dict[str, Any] = {}
        for key in _SAMPLING:
            value = getattr(self, key)
            if value is not None:
                sampling[key] = tuple(value) if isinstance(value, list) else value
        if self.no_stop_trim:
            sampling["include_stop_str_in_output"] = True
        if self.stop is not None:
            sampling["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if self.logit_bias is not None:  # OpenAI's range, as vLLM clamps
            sampling["logit_bias"] = {
                int(key): min(100.0, max(-100.0, value)) for key, value in self.logit_bias.items()
            }
        if logprobs is not None:
            sampling["logprobs"] = logprobs
        if self.prompt_logprobs is not None:
            if self.stream:
                raise InvalidRequest(
                    "'prompt_logprobs' are not available when streaming", param="prompt_logprobs"
                )
            sampling["prompt_logprobs"] = self.prompt_logprobs
        if self.return_tokens_as_token_ids:
            sampling["tokens_as_ids"] = True
        if self.n is not None and self.n > 1:
            sampling["n"] = self.n
        return sampling

    def _beam_search(self, kind: str, sampling: dict[str, Any]) -> None:
        """vLLM's `use_beam_search` (n beams, the n best returned; `length_penalty` weighs
        their lengths) into `sampling`. Sampling parameters beam search does not apply are
        refused."""
        if not self.use_beam_search:
            return
        for key in sampling:
            if key not in _WITH_BEAM:
                param = {"tokens_as_ids": "return_tokens_as_token_ids"}.get(key, key)
                raise UnsupportedParameter(f"'{param}' does not apply to beam search", param=param)
        if kind == "completion" and self.stream:  # vLLM's rule and message
            raise InvalidRequest(
                "Streaming is not currently supported with beam search", param="stream"
            )
        sampling["beam_search"] = True
        if self.length_penalty is not None:
            sampling["length_penalty"] = self.length_penalty

    def _usage_options(self) -> tuple[bool, bool]:
        """(include_usage, continuous_usage) from `stream_options`."""
        options = self.stream_options
        if options is None:
            return False, False
        if not self.stream:
            raise InvalidRequest(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        include = bool(options.include_usage)
        return include, include and bool(options.continuous_usage_stats)  # as vLLM's

    def _output(self) -> dict[str, Any]:
        return {
            key: getattr(self, key) for key in self.output_fields if getattr(self, key) is not None
        }

    def _forwarded_prompt_ids(self) -> tuple[int, ...] | None:
        params = self.kv_transfer_params
        if params is None or params.prompt_token_ids is None:
            return None
        return tuple(params.prompt_token_ids)
