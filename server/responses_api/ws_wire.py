"""The Responses API over a WebSocket on the wire: the client's messages, and the envelope of
the events sent back.

OpenAI's (`response.create`: the create body, with `stream_id` naming the lane; events as
streamed over HTTP, with the lane's `stream_id`; `error` with the HTTP `status`), and Sluice's
own (`response.cancel`, `response.retrieve`, and `response_id` on every event, to tell apart
the responses of several lanes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Field

from server.core.errors import InvalidRequest, SluiceError
from server.openai_wire.wire import WireModel, validated
from server.responses_api.wire import CreateResponse, ResponseEvent

# As the `openai` SDK checks a lane's id.
StreamId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,256}$")]
ResponseId = Annotated[str, Field(min_length=1, max_length=128)]
_ENVELOPE = ("type", "stream_id")  # a create's fields that are not the create body's


class Lane(WireModel):
    stream_id: StreamId | None = None


class CancelMessage(WireModel):
    """Sluice's: cancel a response of this connection, or a background one of the tenant."""

    type: Literal["response.cancel"]
    response_id: ResponseId


class RetrieveMessage(WireModel):
    """Sluice's: a background response's events after `starting_after`, then live (as
    `GET /v1/responses/{id}?stream=true&starting_after=N`)."""

    type: Literal["response.retrieve"]
    response_id: ResponseId
    starting_after: Annotated[int, Field(ge=0)] | None = None
    stream_id: StreamId | None = None


def create_message(message: dict[str, Any]) -> tuple[CreateResponse, str | None]:
    """A `response.create`: its body and its lane (None: the default one)."""
    lane = validated(Lane, {k: message[k] for k in ("stream_id",) if k in message}).stream_id
    body = validated(CreateResponse, {k: v for k, v in message.items() if k not in _ENVELOPE})
    if body.stream is False:
        raise InvalidRequest("a response over the WebSocket always streams", param="stream")
    return body, lane


def lane_of(message: dict[str, Any]) -> str | None:
    """The message's lane, if it names a well-formed one (for an error about the message)."""
    stream_id = message.get("stream_id")
    if isinstance(stream_id, str):
        try:
            return validated(Lane, {"stream_id": stream_id}).stream_id
        except InvalidRequest:
            return None
    return None


def event_message(event: ResponseEvent, response_id: str, stream_id: str | None) -> bytes:
    """A response's event as sent: the event, its response's id and its lane."""
    if stream_id is None:
        return orjson.dumps({**event, "response_id": response_id})
    return orjson.dumps({**event, "response_id": response_id, "stream_id": stream_id})


def error_event(error: SluiceError, stream_id: str | None = None) -> dict[str, Any]:
    """OpenAI's WebSocket `error`: the HTTP status and error body the same refusal would have
    over HTTP (its headers, Retry-After, inside), and the lane it concerns."""
    body = error.to_body()
    headers = error.headers()
    if headers:
        body["error"]["headers"] = headers
    event: dict[str, Any] = {"type": "error", "status": error.status, **body}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event
