"""The OpenAI Batch API's `POST /v1/batches` body."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from server.openai_wire.wire import WireModel

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class CreateBatch(WireModel):
    input_file_id: str
    endpoint: Literal[BATCH_ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None


class FileUpload(WireModel):
    """`POST /v1/files`' multipart form (the route reads the form itself)."""

    file: bytes
    purpose: Literal["batch"]
