"""vLLM's `POST /tokenize` and `POST /detokenize` bodies, and their replies."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from server.openai.chat import Message
from server.openai.wire import TokenId, WireModel, validated


class TokenizeText(WireModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = Field(None, description="default true")
    return_token_strs: bool | None = None


class TokenizeChat(WireModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool | None = Field(None, description="default true")
    return_token_strs: bool | None = None


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
