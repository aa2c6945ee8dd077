"""`POST /v1/completions`'s body, one prompt or several."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from server.core.errors import InvalidRequest
from server.generations.parsed import ParsedRequest
from server.openai_wire.generation_body import GenerationBody, Logprobs
from server.openai_wire.wire import TokenId, ignored_fields

TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(GenerationBody):
    prompt: str | TokenIds | Annotated[list[str | TokenIds], Field(min_length=1)] | None = Field(
        None, description="text, token ids, or several prompts (one choice, or n, each, in order)"
    )
    prompt_embeds: str | list[str] | None = Field(
        None,
        description="vLLM's: base64 of a tensor saved by torch.save, (positions, hidden size); "
        "with --engine-arg enable_prompt_embeds=true; each one a prompt of its own, before "
        "those of `prompt`",
    )
    logprobs: Logprobs | None = Field(
        None, description="how many top tokens (0: the sampled token's alone)"
    )

    def to_parsed(self) -> ParsedRequest:
        """The engine-neutral request for a body of one prompt (`split_prompts` first)."""
        sampling = self._sampling(self.logprobs)
        if self.echo and self.logprobs is not None:  # the prompt's come first
            if self.stream:
                raise InvalidRequest(
                    "'echo' with 'logprobs' needs the prompt's logprobs, which are not "
                    "available when streaming",
                    param="echo",
                )
            sampling.setdefault("prompt_logprobs", self.logprobs)
        # With echo, 0 asks for the prompt alone (vLLM then generates one token and drops it).
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest(
                "'max_tokens': Input should be greater than or equal to 1 (greater_than_equal)",
                param="max_tokens",
            )
        self._beam_search("completion", sampling)
        include_usage, continuous_usage = self._usage_options()
        embeds = self._prompt_embeds()
        return ParsedRequest(
            kind="completion",
            model=self.model,
            messages=None,
            prompt=self._prompt(embeds),
            max_tokens=16 if self.max_tokens is None else self.max_tokens,  # OpenAI's default
            sampling=sampling,
            stream=bool(self.stream),
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            service_tier=self.service_tier,
            add_special_tokens=self.add_special_tokens is not False,
            return_token_ids=bool(self.return_token_ids),
            echo=bool(self.echo),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            output=self._output(),
            forwarded_prompt_ids=self._forwarded_prompt_ids(),
            prompt_embeds=embeds,
            stream_interval=self.stream_interval,
            cache_salt=self.cache_salt,
            ignored=ignored_fields(self),
        )

    def _prompt(self, embeds: str | None) -> str | list[int] | None:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if prompt in (None, "") and embeds is None:  # vLLM's message
            raise InvalidRequest(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if prompt in (None, ""):
            return None  # the embeddings are the prompt
        if isinstance(prompt, str) or all(isinstance(token, int) for token in prompt):
            return prompt  # type: ignore[return-value]
        raise InvalidRequest("'prompt' holds several prompts: send them split", param="prompt")

    def _prompt_embeds(self) -> str | None:
        """vLLM's `prompt_embeds` (base64 of a tensor `torch.save` wrote), one; with a prompt
        they are two prompts, split before this (`split_prompts`). What vLLM refuses with it,
        refused."""
        embeds = self.prompt_embeds
        if isinstance(embeds, list):
            if len(embeds) > 1:
                raise InvalidRequest("send one 'prompt_embeds' per request", param="prompt_embeds")
            embeds = embeds[0] if embeds else None
        if embeds is None:
            return None
        if embeds == "":
            raise InvalidRequest(
                "'prompt_embeds' must be a base64 string or a list of them", param="prompt_embeds"
            )
        for key, what in (
            ("echo", "Echo is unsupported with prompt embeds."),
            ("prompt_logprobs", "prompt_logprobs is not compatible with prompt embeds."),
            (
                "truncate_prompt_tokens",
                "truncate_prompt_tokens is not supported with prompt embeds.",
            ),
            ("use_beam_search", "Embedding prompt not supported for beam search"),
        ):
            if getattr(self, key) not in (None, False):
                raise InvalidRequest(what, param=key)
        if self.prompt not in (None, ""):
            raise InvalidRequest("send 'prompt' or 'prompt_embeds'", param="prompt")
        return embeds


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
