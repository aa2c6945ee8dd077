"""`POST /v1/chat/completions`'s body."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Required, cast

from pydantic import AfterValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from server.core.errors import InvalidRequest, UnsupportedParameter
from server.generations.parsed import ParsedRequest
from server.openai_wire.generation_body import TEXT_ONLY, GenerationBody, Logprobs
from server.openai_wire.wire import UNSUPPORTED, NoEffect, OnlyDefault, WireModel, ignored_fields

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's
# vLLM's batched chat (`POST /v1/chat/completions/batch`, one conversation per choice) takes
# these fields at these values only.
NOT_IN_BATCH: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "n": (None, 1),
    "tools": (None,),
    "kv_transfer_params": (None,),
}
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


def _text_only(content: Any) -> Any:
    for part in content if isinstance(content, list) else ():
        if not (part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise PydanticCustomError(UNSUPPORTED, "only text content parts are supported")
    return content


def _content_or_assistant(message: Any) -> Any:
    if message.get("content") is None and message["role"] != "assistant":
        raise PydanticCustomError("missing", "only the assistant's content may be null")
    return message


class _Message(TypedDict, total=False):
    """A chat message: any role the chat template accepts (as vLLM's server takes), text
    content; its other fields (`name`, `tool_calls`, ...) go to the template as sent. A
    TypedDict, not a model: validated, it is the dict the template takes."""

    __pydantic_config__ = ConfigDict(extra="allow", strict=True)  # type: ignore[misc]

    role: Required[Annotated[str, Field(min_length=1)]]
    content: Annotated[
        str | list[dict[str, Any]] | None,
        AfterValidator(_text_only),
        Field(description="text, or text parts ({type: text, text}); null from the assistant"),
    ]


Message = Annotated[_Message, AfterValidator(_content_or_assistant)]


def messages_of(messages: list[_Message]) -> list[dict[str, Any]]:
    """Validated messages, as the chat template takes them (the dicts pydantic built)."""
    return cast("list[dict[str, Any]]", messages)


class ChatTemplateFields(WireModel):
    """The chat template's arguments, as vLLM's chat requests and chat `/tokenize` take them."""

    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's: extra variables for the chat template (enable_thinking, ...)"
    )
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = Field(
        None, description="the last message left open (with add_generation_prompt: false)"
    )
    chat_template: Annotated[
        Any,
        OnlyDefault(
            None,
            why="a request's own template is not run, as vLLM's server runs none without "
            "--trust-request-chat-template",
        ),
    ] = None
    media_io_kwargs: Annotated[dict[str, Any] | None, NoEffect(TEXT_ONLY)] = None
    mm_processor_kwargs: Annotated[dict[str, Any] | None, NoEffect(TEXT_ONLY)] = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra arguments: vLLM's `chat_template_kwargs`, and its
        `add_generation_prompt` (default true) and `continue_final_message` (the last message
        left open for the model to go on with; then no generation prompt)."""
        kwargs = dict(self.chat_template_kwargs or {})
        for key in kwargs:
            if key in _TEMPLATE_OWN:
                raise InvalidRequest(
                    f"'chat_template_kwargs' may not set '{key}'", param="chat_template_kwargs"
                )
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise InvalidRequest(  # add_generation_prompt's default is true
                "'continue_final_message' needs 'add_generation_prompt': false",
                param="continue_final_message",
            )
        if self.continue_final_message:
            kwargs.update(continue_final_message=True, add_generation_prompt=False)
        elif self.add_generation_prompt is False:
            kwargs["add_generation_prompt"] = False
        return kwargs


class ChatCompletionRequest(GenerationBody, ChatTemplateFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = Field(None, description="with `logprobs: true`")
    reasoning_effort: Literal[REASONING_EFFORTS] | None = Field(  # type: ignore[valid-type]
        None,
        description="given to the chat template; also its enable_thinking, unless "
        "chat_template_kwargs sets it",
    )
    documents: list[dict[str, str]] | None = Field(
        None, description="vLLM's: documents for a RAG chat template"
    )
    # Tools and reasoning: the engine's to apply.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None
    # SGLang's, as vLLM's router sends them: at these values, what Sluice does anyway.
    separate_reasoning: Annotated[Any, OnlyDefault(True)] = None
    stream_reasoning: Annotated[Any, OnlyDefault(True)] = None
    return_prompt_text: Annotated[Any, OnlyDefault(False)] = None

    output_fields: ClassVar[tuple[str, ...]] = (
        "response_format",
        "structured_outputs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "include_reasoning",
    )

    def to_parsed(self) -> ParsedRequest:
        """The engine-neutral request (cross-field rules checked here)."""
        logprobs = self._logprobs()
        sampling = self._sampling(logprobs)
        if self.add_special_tokens:
            raise UnsupportedParameter(
                "'add_special_tokens' is not supported for chat: the chat "
                "template adds the model's special tokens",
                param="add_special_tokens",
            )
        self._beam_search("chat", sampling)
        include_usage, continuous_usage = self._usage_options()
        return ParsedRequest(
            kind="chat",
            model=self.model,
            messages=messages_of(self.messages),
            prompt=None,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            sampling=sampling,
            stream=bool(self.stream),
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            service_tier=self.service_tier,
            return_token_ids=bool(self.return_token_ids),
            echo=bool(self.echo),
            template_kwargs=self._template_kwargs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            output=self._output(),
            forwarded_prompt_ids=self._forwarded_prompt_ids(),
            stream_interval=self.stream_interval,
            cache_salt=self.cache_salt,
            ignored=ignored_fields(self),
        )

    def _logprobs(self) -> int | None:
        """`logprobs: true` and `top_logprobs: k`: k top tokens for each; None: no logprobs."""
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def _template_kwargs(self) -> dict[str, Any] | None:
        """The template's arguments (`template_kwargs`), and the chat's own for it."""
        kwargs = self.template_kwargs()
        # As vLLM passes them: to the template (which may ignore them), and an effort also
        # turns thinking on or off for templates that ask (unless chat_template_kwargs says).
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None
