"""JSON replies and errors, and request bodies read within a bound: the same for every API."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from server.core.errors import InvalidRequest, PayloadTooLarge, SluiceError


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        # Keys that are not strings as JSON has them, as Python's json does: a render's
        # sampling echoes `logit_bias`, whose token ids pydantic made ints.
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def error_response(
    error: SluiceError, request_id: str | None = None, body: dict[str, Any] | None = None
) -> JSONResponse:
    """`error` with its status and headers (Retry-After where it has one); its body OpenAI's
    unless another API's is given."""
    headers = error.headers()
    if request_id:
        headers["X-Request-Id"] = request_id
    content = error.to_body() if body is None else body
    return JSONResponse(content, status_code=error.status, headers=headers)


async def read_json(request: Request, limit: int) -> Any:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise InvalidRequest("the request body must be sent as 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
