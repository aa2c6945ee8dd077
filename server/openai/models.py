"""Sluice's replies that no SDK declares: `/v1/models` (OpenAI's model object, with vLLM's
`root`, `parent` and `max_model_len`), `/health`, `/ready` and `/version`. The handlers build their
replies from these models, and `/openapi.json` documents them by the same models."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sluice"
    root: str  # where the weights were read from (vLLM's)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    status: Literal["alive"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str


class VersionReply(BaseModel):
    version: str
