"""OpenAI's error object, as every error renders (see `server.core.errors.SluiceError.to_body`)."""

from __future__ import annotations

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail
