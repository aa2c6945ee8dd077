"""Parse and validate OpenAI-shaped request bodies into engine-neutral values.

Accepted: the OpenAI chat/completions parameters Sluice implements, plus the extra sampling
parameters vLLM's server accepts (`top_k`, `min_p`, `min_tokens`, `ignore_eos`,
`repetition_penalty`, `stop_token_ids`, ...), so clients written for vLLM work unchanged.
Anything else is refused with 400 `unsupported_parameter` rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_adapters.protocol import SamplingOptions
from server.core.errors import InvalidRequest, UnsupportedParameter

# Parameters that change nothing Sluice does when left at these values; other values refused.
# Compared by type as well as value: `logprobs: 0` asks for logprobs, though `0 == False`.
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "suffix": ("",),
}
# Parameters accepted and with no effect on generation (metadata, hints).
_IGNORED = {
    "user",
    "metadata",
    "store",
    "spaces_between_special_tokens",
    "request_id",
    "priority",
    "stream_options",
}

_SAMPLING = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "max_tokens",
    "allowed_token_ids",
    "bad_words",
}
# How the output is shaped (structured outputs, tools, reasoning): the engine's to apply, each
# checked here for its JSON type only (see EngineClient.plan_output).
_OUTPUT: dict[str, tuple[type, ...]] = {"response_format": (dict,), "structured_outputs": (dict,)}
_CHAT_OUTPUT: dict[str, tuple[type, ...]] = {
    **_OUTPUT,
    "tools": (list,),
    "tool_choice": (str, dict),
    "parallel_tool_calls": (bool,),
    "include_reasoning": (bool,),
}
_COMMON = {
    "model",
    "stream",
    "service_tier",
    "add_special_tokens",
    "logprobs",
    "n",
    "echo",
    "return_tokens_as_token_ids",
    "kv_transfer_params",
    "use_beam_search",
    "length_penalty",
    "prompt_logprobs",
    "return_token_ids",
    "truncate_prompt_tokens",
    "truncation_side",
    *_SAMPLING,
    *_ONLY_DEFAULT,
    *_IGNORED,
    *_OUTPUT,
}
_CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "reasoning_effort",
    "documents",
    *_CHAT_OUTPUT,
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
MAX_LOGPROBS = 20  # vLLM's default `max_logprobs`
MAX_CHOICES = 128  # OpenAI's limit on n
_COMPLETION_ONLY = {"prompt", "prompt_embeds"}
# What vLLM's beam search does not apply (it would drop them): refused with it.
_NOT_WITH_BEAM = (
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "tokens_as_ids",
    "allowed_token_ids",
    "bad_words",
)
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}


def accepted_fields(kind: str) -> set[str]:
    """Every top-level field a `kind` ("chat" or "completion") body may have."""
    return _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """An OpenAI request, validated. `max_tokens` is None when the client set no limit."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    max_tokens: int | None
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    service_tier: str | None
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's continuous_usage_stats)
    add_special_tokens: bool = True  # for a text prompt (chat templates bring their own)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids too
    # Completions: the prompt comes first in the text (and logprobs); chat: the last message's
    # content, if the assistant's (the one it continues).
    echo: bool = False
    template_kwargs: dict[str, Any] | None = None  # chat: vLLM's chat_template_kwargs
    # vLLM's: keep this many prompt tokens (-1: the context's worth), the last or the first.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    output: dict[str, Any] = field(default_factory=dict)  # the output-shaping fields sent
    # vLLM's kv_transfer_params.prompt_token_ids: a prefill stage's prompt, forwarded by a
    # disaggregated-serving router, used verbatim instead of the messages or prompt.
    forwarded_prompt_ids: tuple[int, ...] | None = None
    # Completions: vLLM's prompt_embeds, one tensor's base64 text (then `prompt` is None).
    prompt_embeds: str | None = None

    @property
    def n(self) -> int:
        return int(self.sampling.get("n", 1))

    def sampling_options(
        self, max_tokens: int, constraint: object | None = None
    ) -> SamplingOptions:
        return SamplingOptions(max_tokens=max_tokens, constraint=constraint, **self.sampling)


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise InvalidRequest(message, param=param)


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    _check(
        isinstance(value, int | float) and not isinstance(value, bool),
        f"'{key}' must be a number",
        key,
    )
    _check(lo <= value <= hi, f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    # One message for both failures: orjson reads an integer beyond 64 bits as a float.
    bounds = f"at least {lo}" + (f" and at most {hi}" if hi is not None else "")
    _check(
        isinstance(value, int | float) and not isinstance(value, bool),
        f"'{key}' must be an integer, {bounds}",
        key,
    )
    # Named as pydantic names them too (vLLM's server answers with pydantic's messages). A
    # float at a bound is an integer beyond it, rounded by orjson.
    at_bound = isinstance(value, float)
    _check(
        value > lo if at_bound else value >= lo,
        f"'{key}' must be an integer, {bounds} (greater_than_equal)",
        key,
    )
    _check(
        hi is None or (value < hi if at_bound else value <= hi),
        f"'{key}' must be an integer, {bounds} (less_than_equal)",
        key,
    )
    _check(isinstance(value, int), f"'{key}' must be an integer, {bounds}", key)
    return int(value)


def boolean_from(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    _check(isinstance(value, bool), f"'{key}' must be a boolean", key)
    return bool(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    _check(
        isinstance(value, list) and len(value) <= 16 and all(isinstance(s, str) for s in value),
        "'stop' must be a string or a list of at most 16 strings",
        "stop",
    )
    return tuple(value)


def token_ids_from(body: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    value = body.get(key)
    if value is None:
        return None
    _check(
        isinstance(value, list)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value),
        f"'{key}' must be a list of token ids",
        key,
    )
    return tuple(value)


def _forwarded_prompt_ids(body: Mapping[str, Any]) -> tuple[int, ...] | None:
    """vLLM's `kv_transfer_params`: only its `prompt_token_ids` (Sluice runs no KV connector,
    so any other key would be ignored: it is refused instead)."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    _check(isinstance(params, dict), "'kv_transfer_params' must be an object", "kv_transfer_params")
    for key in params:
        if key != "prompt_token_ids":
            raise UnsupportedParameter(
                f"'kv_transfer_params.{key}' needs a KV connector, which this server does not run",
                param=f"kv_transfer_params.{key}",
            )
    param = "kv_transfer_params.prompt_token_ids"
    try:
        ids = token_ids_from(params, "prompt_token_ids")
    except InvalidRequest as exc:
        raise InvalidRequest(
            exc.message.replace("'prompt_token_ids'", f"'{param}'"), param=param
        ) from None
    _check(ids is None or len(ids) > 0, f"'{param}' must not be empty", param)
    return ids


def _allowed_token_ids(body: Mapping[str, Any]) -> tuple[int, ...] | None:
    """vLLM's: only these tokens may be generated."""
    ids = token_ids_from(body, "allowed_token_ids")
    _check(
        ids is None or len(ids) > 0, "'allowed_token_ids' must not be empty", "allowed_token_ids"
    )
    return ids


def _bad_words(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """vLLM's: words (token sequences) never to be generated."""
    value = body.get("bad_words")
    if value is None:
        return None
    _check(
        isinstance(value, list) and all(isinstance(w, str) and w for w in value),
        "'bad_words' must be a list of non-empty strings",
        "bad_words",
    )
    return tuple(value)


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    _check(isinstance(value, dict), "'logit_bias' must be an object", "logit_bias")
    bad = [key for key in value if not key.strip().isdigit()]
    _check(
        not bad,
        "'logit_bias' keys must be token ids; not: " + ", ".join(repr(key) for key in bad),
        "logit_bias",
    )
    bias = {}
    for key, number in value.items():
        _check(
            isinstance(number, int | float) and not isinstance(number, bool),
            f"'logit_bias' value for {key!r} must be a number",
            "logit_bias",
        )
        bias[int(key)] = min(100.0, max(-100.0, float(number)))  # OpenAI's range, as vLLM clamps
    return bias


_SAMPLING_READERS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "temperature": lambda b: _number(b, "temperature", 0.0, 2.0),
    "top_p": lambda b: _number(b, "top_p", 1e-9, 1.0),
    "top_k": lambda b: _integer(b, "top_k", -1),
    "min_p": lambda b: _number(b, "min_p", 0.0, 1.0),
    "min_tokens": lambda b: _integer(b, "min_tokens", 0),
    "presence_penalty": lambda b: _number(b, "presence_penalty", -2.0, 2.0),
    "frequency_penalty": lambda b: _number(b, "frequency_penalty", -2.0, 2.0),
    "repetition_penalty": lambda b: _number(b, "repetition_penalty", 1e-9, 10.0),
    "seed": lambda b: _integer(b, "seed", -(2**63), 2**63 - 1),
    "stop": _stop,
    "stop_token_ids": lambda b: token_ids_from(b, "stop_token_ids"),
    "ignore_eos": lambda b: boolean_from(b, "ignore_eos"),
    "skip_special_tokens": lambda b: boolean_from(b, "skip_special_tokens"),
    "include_stop_str_in_output": lambda b: boolean_from(b, "include_stop_str_in_output"),
    "logit_bias": _logit_bias,
    "allowed_token_ids": _allowed_token_ids,
    "bad_words": _bad_words,
}


def _logprobs(body: Mapping[str, Any], kind: str) -> int | None:
    """How many top tokens each generated token's logprobs list; None: no logprobs.

    Chat: `logprobs: true` and `top_logprobs: k`. Completions: `logprobs: k` (0 is the sampled
    token's alone, and still asks for logprobs)."""
    if kind == "completion":
        return _integer(body, "logprobs", 0, MAX_LOGPROBS)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not boolean_from(body, "logprobs"):
        _check(not top, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


# Set by the server itself when it renders the template (the last two from their own fields).
_TEMPLATE_OWN = {
    "messages",
    "tools",
    "tokenize",
    "conversation",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "reasoning_effort",
}


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The chat template's extra arguments: vLLM's `chat_template_kwargs`, and its
    `add_generation_prompt` (default true) and `continue_final_message` (the last message
    left open for the model to go on with; then no generation prompt)."""
    value = body.get("chat_template_kwargs")
    _check(
        value is None or isinstance(value, dict),
        "'chat_template_kwargs' must be an object",
        "chat_template_kwargs",
    )
    kwargs = dict(value or {})
    for key in kwargs:
        _check(
            key not in _TEMPLATE_OWN,
            f"'chat_template_kwargs' may not set '{key}'",
            "chat_template_kwargs",
        )
    generation_prompt = boolean_from(body, "add_generation_prompt")
    continue_final = boolean_from(body, "continue_final_message")
    _check(
        not (continue_final and generation_prompt is not False),  # its default is true
        "'continue_final_message' needs 'add_generation_prompt': false",
        "continue_final_message",
    )
    if continue_final:
        kwargs.update(continue_final_message=True, add_generation_prompt=False)
    elif generation_prompt is False:
        kwargs["add_generation_prompt"] = False
    # As vLLM passes them: to the template (which may ignore them), and an effort also turns
    # thinking on or off for templates that ask (unless chat_template_kwargs says).
    documents = body.get("documents")
    _check(
        documents is None
        or (
            isinstance(documents, list)
            and all(
                isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                for d in documents
            )
        ),
        "'documents' must be a list of objects of strings",
        "documents",
    )
    effort = body.get("reasoning_effort")
    _check(
        effort is None or effort in REASONING_EFFORTS,
        "'reasoning_effort' must be one of " + ", ".join(REASONING_EFFORTS),
        "reasoning_effort",
    )
    if documents is not None:
        kwargs["documents"] = documents
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def _truncation_side(body: Mapping[str, Any]) -> str:
    side = body.get("truncation_side")
    _check(
        side in (None, "left", "right"),
        "'truncation_side' must be 'left' or 'right'",
        "truncation_side",
    )
    return str(side or "left")


def messages_from(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    _check(
        isinstance(messages, list) and len(messages) > 0,
        "'messages' must be a non-empty list",
        "messages",
    )
    assert isinstance(messages, list)
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        _check(isinstance(message, dict), "each message must be an object", param)
        # Any role the chat template accepts, as vLLM's server does.
        _check(
            isinstance(message.get("role"), str) and message["role"] != "",
            "'role' must be a non-empty string",
            f"{param}.role",
        )
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise UnsupportedParameter(
                        "only text content parts are supported", param=f"{param}.content"
                    )
        else:
            _check(
                isinstance(content, str) or (content is None and message["role"] == "assistant"),
                "'content' must be a string or a list of text parts",
                f"{param}.content",
            )
    return messages


def split_prompts(body: Any) -> list[dict[str, Any]] | None:
    """A completions body with several prompts (a list of strings or of token-id lists, and
    vLLM's `prompt_embeds`, embeddings first as vLLM orders them) as one body per prompt;
    None for one prompt."""
    if not isinstance(body, dict):
        return None
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    texts = (
        prompt
        if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt) and prompt
        else [prompt]
    )
    tensors = embeds if isinstance(embeds, list) and embeds else [embeds]
    parts = [{"prompt_embeds": e} for e in tensors if e is not None] + [
        {"prompt": p} for p in texts if p not in (None, "")
    ]
    if len(parts) < 2:
        return None
    return [{**body, "prompt": None, "prompt_embeds": None, **part} for part in parts]


def _prompt(body: Mapping[str, Any]) -> str | list[int] | None:
    prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if prompt in (None, "") and embeds in (None, []):  # vLLM's message
        raise InvalidRequest(
            "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
        )
    if prompt in (None, ""):
        return None  # the embeddings are the prompt
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return prompt
    raise InvalidRequest("'prompt' must be a string or a list of token ids", param="prompt")


def _prompt_embeds(body: Mapping[str, Any]) -> str | None:
    """vLLM's `prompt_embeds` (base64 of a tensor `torch.save` wrote), one; with a prompt they
    are two prompts, split before this (`split_prompts`). What vLLM refuses with it, refused."""
    embeds = body.get("prompt_embeds")
    if isinstance(embeds, list) and len(embeds) == 1:
        embeds = embeds[0]
    if embeds is None:
        return None
    _check(
        isinstance(embeds, str) and embeds != "",
        "'prompt_embeds' must be a base64 string or a list of them",
        "prompt_embeds",
    )
    for key, what in (
        ("echo", "Echo is unsupported with prompt embeds."),
        ("prompt_logprobs", "prompt_logprobs is not compatible with prompt embeds."),
        ("truncate_prompt_tokens", "truncate_prompt_tokens is not supported with prompt embeds."),
        ("use_beam_search", "Embedding prompt not supported for beam search"),
    ):
        _check(body.get(key) in (None, False), what, key)
    _check(body.get("prompt") in (None, ""), "send 'prompt' or 'prompt_embeds'", "prompt")
    return embeds


def _beam_search(body: Mapping[str, Any], kind: str, sampling: dict[str, Any]) -> None:
    """vLLM's `use_beam_search` (n beams, the n best returned; `length_penalty` weighs their
    lengths) into `sampling`. Sampling parameters beam search does not apply are refused."""
    length_penalty = _number(body, "length_penalty", -1e9, 1e9)
    if not boolean_from(body, "use_beam_search"):
        return
    for key in _NOT_WITH_BEAM:
        if key in sampling:
            param = {"tokens_as_ids": "return_tokens_as_token_ids"}.get(key, key)
            raise UnsupportedParameter(f"'{param}' does not apply to beam search", param=param)
    _check(
        kind == "chat" or not boolean_from(body, "stream"),  # vLLM's rule and message
        "Streaming is not currently supported with beam search",
        "stream",
    )
    sampling["beam_search"] = True
    if length_penalty is not None:
        sampling["length_penalty"] = length_penalty


def parse_request(body: Any, kind: str) -> ParsedRequest:
    """Validate a decoded JSON body for `kind` ("chat" or "completion")."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    allowed = accepted_fields(kind)
    for key, value in body.items():
        if key not in allowed:
            raise UnsupportedParameter(f"unsupported parameter '{key}'", param=key)
        if (
            key in _ONLY_DEFAULT
            and value is not None
            and not any(
                type(value) is type(default) and value == default for default in _ONLY_DEFAULT[key]
            )
        ):
            raise UnsupportedParameter(
                f"'{key}'={value!r} is not supported by this server", param=key
            )
    model = body.get("model")
    _check(model is None or isinstance(model, str), "'model' must be a string", "model")

    sampling = {}
    for key, read in _SAMPLING_READERS.items():
        value = read(body)
        if value is not None:
            sampling[key] = value
    logprobs = _logprobs(body, kind)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    prompt_logprobs = _integer(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        _check(
            not boolean_from(body, "stream"),
            "'prompt_logprobs' are not available when streaming",
            "prompt_logprobs",
        )
        sampling["prompt_logprobs"] = prompt_logprobs
    if boolean_from(body, "return_tokens_as_token_ids"):
        sampling["tokens_as_ids"] = True
    n = _integer(body, "n", 1, MAX_CHOICES)
    if n is not None and n > 1:
        sampling["n"] = n
    echo = bool(boolean_from(body, "echo"))
    if echo and kind == "completion" and logprobs is not None:  # the prompt's come first
        _check(
            not boolean_from(body, "stream"),
            "'echo' with 'logprobs' needs the prompt's "
            "logprobs, which are not available when streaming",
            "echo",
        )
        sampling.setdefault("prompt_logprobs", logprobs)
    # With echo, 0 asks for the prompt alone (vLLM then generates one token and drops it).
    max_tokens = _integer(body, "max_tokens", 0 if echo and kind == "completion" else 1)
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", 1) or max_tokens
        if boolean_from(body, "add_special_tokens"):
            raise UnsupportedParameter(
                "'add_special_tokens' is not supported for chat: the chat "
                "template adds the model's special tokens",
                param="add_special_tokens",
            )
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's default for completions
    _beam_search(body, kind, sampling)

    stream = boolean_from(body, "stream") or False
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        _check(isinstance(options, dict), "'stream_options' must be an object", "stream_options")
        _check(stream, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        for key in options:
            if key not in _STREAM_OPTIONS:
                raise UnsupportedParameter(
                    f"unsupported stream option '{key}'", param=f"stream_options.{key}"
                )
        include_usage = boolean_from(options, "include_usage") or False
        continuous_usage = boolean_from(options, "continuous_usage_stats") or False
        continuous_usage = continuous_usage and include_usage  # as vLLM: no usage, none
    output = {}
    for key, types in (_CHAT_OUTPUT if kind == "chat" else _OUTPUT).items():
        if body.get(key) is not None:
            _check(
                isinstance(body[key], types),
                f"'{key}' must be " + " or ".join(_JSON_NAMES[t] for t in types),
                key,
            )
            output[key] = body[key]
    tier = body.get("service_tier")
    _check(
        tier is None or tier in ("auto", "default", "flex", "priority"),
        "'service_tier' must be one of auto, default, flex, priority",
        "service_tier",
    )
    return ParsedRequest(
        kind=kind,
        model=model,
        messages=messages_from(body) if kind == "chat" else None,
        prompt=_prompt(body) if kind == "completion" else None,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        service_tier=tier,
        add_special_tokens=boolean_from(body, "add_special_tokens") is not False,
        return_token_ids=boolean_from(body, "return_token_ids") or False,
        echo=echo,
        template_kwargs=_template_kwargs(body) if kind == "chat" else None,
        truncate_prompt_tokens=_integer(body, "truncate_prompt_tokens", -1),
        truncation_side=_truncation_side(body),
        output=output,
        forwarded_prompt_ids=_forwarded_prompt_ids(body),
        prompt_embeds=_prompt_embeds(body) if kind == "completion" else None,
    )
