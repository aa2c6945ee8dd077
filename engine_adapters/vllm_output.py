"""Structured outputs, tool calls and reasoning on the vLLM engine, with vLLM's own parts.

vLLM's request models (`ChatCompletionRequest`, `CompletionRequest`) validate the fields and
turn `response_format`, `structured_outputs` and a named or `required` tool choice into its
`StructuredOutputsParams` (the grammar the engine enforces). vLLM's parsers (`--tool-call-parser`,
`--reasoning-parser`, `--enable-auto-tool-choice`, spelled as vLLM's server spells them) read
the generated text into content, reasoning and tool calls. This module checks what vLLM's
server checks before it renders a prompt, in the same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapters.protocol import (
    PLAIN_TEXT,
    EngineRequestError,
    OutputParser,
    OutputPlan,
    OutputRequest,
)


@dataclass(frozen=True, slots=True)
class ParserOptions:
    """vLLM's server flags for reading output: `--tool-call-parser`,
    `--enable-auto-tool-choice`, `--reasoning-parser`."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None


def _blamed(request: OutputRequest) -> str | None:
    """The field to name when vLLM does not say: the constraint the request sent."""
    return next(
        (
            key
            for key in ("response_format", "structured_outputs", "tool_choice", "tools")
            if key in request.fields
        ),
        None,
    )


def _validated(model: Any, body: dict[str, Any], request: OutputRequest) -> Any:
    """vLLM's request model for `body`; its complaints as a 400 naming the field."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMValidationError

    try:
        return model.model_validate(body)
    except VLLMValidationError as exc:
        raise EngineRequestError(
            str(exc.args[0] if exc.args else exc), param=exc.parameter or _blamed(request)
        ) from None
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        raise EngineRequestError(
            f"'{path}': {error['msg']}", param=str(error["loc"][0]) if error["loc"] else None
        ) from None


class VLLMOutputPlanner:
    """Plans each request's output on one vLLM engine: its parsers and its tokenizer."""

    def __init__(self, options: ParserOptions, tokenizer: Any, vllm_config: Any) -> None:
        from vllm.parser.parser_manager import ParserManager

        self._options = options
        self._tokenizer = tokenizer
        self._vllm_config = vllm_config
        self._model_config = model_config = vllm_config.model_config
        self._parser_cls = ParserManager.get_parser(
            tool_parser_name=options.tool_call_parser,
            reasoning_parser_name=options.reasoning_parser,
            enable_auto_tools=options.enable_auto_tool_choice,
            model_name=model_config.model,
            tokenizer=tokenizer,
        )

    def plan(self, request: OutputRequest) -> OutputPlan:
        if request.kind != "chat":
            if not request.fields:
                return PLAIN_TEXT
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest

            # The prompt is checked elsewhere; vLLM's model only wants one there.
            completion = _validated(CompletionRequest, {"prompt": "-", **request.fields}, request)
            return OutputPlan(
                constraint=self._checked(completion.extract_structured_outputs(), request)
            )
        if not request.fields and self._parser_cls is None:
            return PLAIN_TEXT
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        chat = _validated(
            ChatCompletionRequest,
            {"messages": list(request.messages or ()), **request.fields},
            request,
        )
        self._check_tool_choice(chat)
        parser_cls = self._parser_cls
        kwargs = dict(request.template_kwargs or {})
        if parser_cls is not None and (
            parser_cls.reasoning_parser_cls is not None or chat.tool_choice != "none"
        ):
            # As vLLM's renderer does: the parser may constrain the output (a named or
            # required tool choice becomes a JSON schema).
            chat = parser_cls(
                self._tokenizer,
                chat.tools,
                model_config=self._model_config,
                chat_template_kwargs=kwargs,
            ).adjust_request(chat)
        tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
        return OutputPlan(
            constraint=self._checked(chat.extract_structured_outputs(), request),
            tools=tools,
            parser=None
            if parser_cls is None
            else (
                lambda prompt_token_ids: VLLMOutputParser(
                    parser_cls(
                        self._tokenizer,
                        chat.tools,
                        model_config=self._model_config,
                        chat_template_kwargs=kwargs,
                    ),
                    chat,
                    self._options.enable_auto_tool_choice,
                    prompt_token_ids,
                )
            ),
        )

    def _checked(self, constraint: Any, request: OutputRequest) -> Any:
        """vLLM's own check of a constraint (its schema or grammar converts for the engine's
        backend), done when vLLM's engine takes a request, here before Sluice queues it."""
        if constraint is None:
            return None
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        config = self._vllm_config
        try:
            SamplingParams(max_tokens=1, structured_outputs=constraint).verify(
                config.model_config,
                config.speculative_config,
                config.structured_outputs_config,
                self._tokenizer,
            )
        except (VLLMValidationError, ValueError) as exc:
            raise EngineRequestError(str(exc), param=_blamed(request)) from None
        return constraint

    def _check_tool_choice(self, chat: Any) -> None:
        """vLLM's server: any tool choice but "none" needs a tool parser; "auto" also needs
        auto tool choice enabled."""
        if chat.tool_choice in (None, "none") or (
            self._parser_cls is not None and self._parser_cls.tool_parser_cls is not None
        ):
            return
        if chat.tool_choice == "auto":
            if not self._options.enable_auto_tool_choice:
                raise EngineRequestError(
                    '"auto" tool choice requires --enable-auto-tool-choice '
                    "and --tool-call-parser to be set",
                    param="tool_choice",
                )
            return
        described = (
            f'"{chat.tool_choice}"'
            if isinstance(chat.tool_choice, str)
            else f'function "{chat.tool_choice.function.name}"'
        )
        raise EngineRequestError(
            f"tool_choice={described} requires --tool-call-parser to be set", param="tool_choice"
        )


class VLLMOutputParser(OutputParser):
    """One choice's text through vLLM's `Parser` (tool calls and reasoning), as OpenAI fields."""

    def __init__(
        self, parser: Any, request: Any, enable_auto_tools: bool, prompt_token_ids: Sequence[int]
    ) -> None:
        self._parser = parser
        self._parser.set_prompt_token_ids(prompt_token_ids)
        self._prompt: list[int] | None = list(prompt_token_ids)  # for the first delta only
        self._request = request
        self._auto = enable_auto_tools
        self._named = request.tool_choice is not None and not isinstance(request.tool_choice, str)
        self._single = request.parallel_tool_calls is False

    def delta(self, text: str, token_ids: Sequence[int], finished: bool) -> dict[str, Any] | None:
        message = self._parser.parse_delta(
            text, list(token_ids), self._request, prompt_token_ids=self._prompt, finished=finished
        )
        self._prompt = None
        if message is None:
            return None
        if self._single and message.tool_calls:  # as vLLM: only the first call
            message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        fields: dict[str, Any] = message.model_dump(exclude_none=True)
        return fields or None

    def message(self, text: str, token_ids: Sequence[int]) -> dict[str, Any]:
        from vllm.entrypoints.generate.base.protocol import ToolCall

        reasoning, content, calls = self._parser.parse(
            text, self._request, enable_auto_tools=self._auto, model_output_token_ids=token_ids
        )
        if not self._request.include_reasoning:
            reasoning = None
        tool_calls = [
            ToolCall(id=call.id, function=call) if call.id else ToolCall(function=call)
            for call in calls or ()
        ]
        if self._single:
            tool_calls = tool_calls[:1]
        return {
            "content": content,
            "reasoning": reasoning,
            "tool_calls": [call.model_dump() for call in tool_calls],
        }

    def finish_reason(self, reason: str, called_tools: bool) -> str:
        # OpenAI's: "tool_calls" when the model chose to call (auto or required), "stop" when
        # the client named the function.
        return "tool_calls" if called_tools and reason == "stop" and not self._named else reason
