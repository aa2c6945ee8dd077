"""Sluice's replies that no SDK declares: `/v1/models` (OpenAI's model object, with vLLM's
`root`, `parent` and `max_model_len`), `/health`, `/ready` and `/version`; and the bodies of
vLLM's adapter routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`). The handlers
build their replies from these models, and `/openapi.json` documents them by the same models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from server.openai_wire.wire import OnlyDefault, WireModel


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


class LoadLoRAAdapter(WireModel):
    """`POST /v1/load_lora_adapter`, as vLLM's server takes it."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # vLLM's reload of an adapter already loaded: not served (unload it, then load it).
    load_inplace: Annotated[bool, OnlyDefault(False)] = False


class UnloadLoRAAdapter(WireModel):
    """`POST /v1/unload_lora_adapter`, as vLLM's server takes it (by name)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # (vLLM's; the name is what Sluice knows an adapter by)


class Status(BaseModel):
    status: Literal["alive"]


class Ready(BaseModel):
    status: Literal["ready"]
    model: str


class VersionReply(BaseModel):
    version: str
