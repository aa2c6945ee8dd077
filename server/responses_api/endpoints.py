"""OpenAI's Responses API's endpoints, over HTTP and a WebSocket: each one's method, path,
handler and OpenAPI operation. Each handler is handed the API's `Responses` after the
services; the app serves them only where it has a store of responses."""

from __future__ import annotations

from server.http.endpoints import Endpoint
from server.http.operations import (
    SEQUENCE,
    Operation,
    Schema,
    generation,
    param,
    post,
    reply,
    request,
    with_id,
)
from server.openai_wire.render import RenderReply
from server.responses_api.routes import (
    cancel_response,
    create_response,
    get_response,
    render_response,
)
from server.responses_api.service import Responses
from server.responses_api.websocket import responses_websocket
from server.responses_api.wire import CreateResponse

_RESPONSE_ID = "a response id"


def _create_response() -> Operation:
    from openai.types.responses import Response

    return generation(
        "OpenAI's Responses API: a response (whole, streamed, or in the background)",
        request(CreateResponse),
        Schema(Response),
        idempotent=False,
    )


def _render_response() -> Operation:
    return post(
        "vLLM's: the response's chat rendered into what the engine would run (stateless: "
        "no previous_response_id)",
        request(CreateResponse),
        Schema(RenderReply),
    )


def _get_response() -> Operation:
    from openai.types.responses import Response

    summary = "a stored response, or with `stream` a background response's events"
    return {
        "summary": summary,
        "parameters": [
            param("stream", "query", {"type": "boolean"}, "a background response's events"),
            param(
                "starting_after",
                "query",
                SEQUENCE,
                "with `stream`: the events after this sequence number",
            ),
        ],
        "responses": {"200": reply(summary, Schema(Response), stream=True)},
    }


def _cancel_response() -> Operation:
    from openai.types.responses import Response

    summary = "cancel a background response"
    return {"summary": summary, "responses": {"200": reply(summary, Schema(Response))}}


ENDPOINTS: tuple[Endpoint[Responses], ...] = (
    Endpoint("POST", "/v1/responses", create_response, _create_response, "responses"),
    Endpoint("POST", "/v1/responses/render", render_response, _render_response, "responses"),
    Endpoint(
        "GET",
        "/v1/responses/{id}",
        get_response,
        with_id(_get_response, _RESPONSE_ID),
        "responses",
    ),
    Endpoint(
        "POST",
        "/v1/responses/{id}/cancel",
        cancel_response,
        with_id(_cancel_response, _RESPONSE_ID),
        "responses",
    ),
    Endpoint("WEBSOCKET", "/v1/responses", responses_websocket, part="responses"),
)
