"""vLLM's `POST /tokenize` and `POST /detokenize` bodies, and their replies."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from server.openai_wire.chat import ChatTemplateFields, Message
from server.openai_wire.wire import OnlyDefault, TokenId, WireModel, validated


class TokenizeText(WireModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = Field(None, description="default true")
    return_token_strs: bool | None = None


class TokenizeChat(ChatTemplateFields):
    """vLLM's chat `/tokenize`: the messages through the chat template, as a chat renders
    them (its template's arguments, and the tools on offer)."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    return_token_strs: bool | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="shown to the chat template")
    add_special_tokens: Annotated[
        Any, OnlyDefault(False, why="the chat template adds the model's special tokens")
    ] = None


class Detokenize(WireModel):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeReply(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeReply(BaseModel):
    prompt: str


def tokenize_body(body: Any) -> TokenizeText | TokenizeChat:
    """A chat body if it has `messages`, else a text one."""
    if isinstance(body, dict) and "messages" in body:
        return validated(TokenizeChat, body)
    return validated(TokenizeText, body)
