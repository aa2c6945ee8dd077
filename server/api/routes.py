"""The app's endpoints: each API's table (`server.<api>.endpoints.ENDPOINTS`), joined, and the
server's own (health, readiness, models, LoRA adapters, metrics, the chat page, this document),
declared here beside their handlers. The app's Starlette routes and `/openapi.json`'s paths are
both read from the joined table (`ENDPOINTS`), so the document lists what is served and nothing
else."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from engine_adapters.protocol import AdapterLoadFailed, AdapterNotFound, EngineRequestError
from server.anthropic import endpoints as anthropic
from server.anthropic.messages import CountTokensRequest, MessagesRequest
from server.api import openapi
from server.batch_api import endpoints as batch_api
from server.batch_api.routes import BatchServices
from server.batch_api.wire import CreateBatch
from server.chat_api import endpoints as chat_api
from server.chat_api.tokenizer import VERSION
from server.conversations_api import endpoints as conversations_api
from server.conversations_api.service import Conversations
from server.conversations_api.wire import AddItems, CreateConversation, UpdateConversation
from server.core.errors import (
    AdapterLoadError,
    EngineUnavailable,
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    ShuttingDown,
)
from server.http.edge import context_of
from server.http.endpoints import Endpoint, Part
from server.http.operations import Operation, Schema, get, json_content, post, request
from server.http.replies import JSONResponse, error_response, read_json
from server.http.services import Services
from server.openai_wire.chat import ChatCompletionRequest
from server.openai_wire.completion import CompletionRequest
from server.openai_wire.error_body import ErrorBody
from server.openai_wire.models import (
    LoadLoRAAdapter,
    ModelCard,
    ModelList,
    Ready,
    Status,
    UnloadLoRAAdapter,
)
from server.openai_wire.tokenizer import Detokenize, TokenizeChat, TokenizeText
from server.openai_wire.wire import WireModel, ignorable_paths, validated
from server.responses_api import endpoints as responses_api
from server.responses_api.service import Responses
from server.responses_api.wire import CreateResponse
from server.websocket_api import endpoints as websocket_api

STATIC = Path(__file__).parent / "static"


async def health(services: Services, request: Request) -> Response:
    return JSONResponse(Status(status="alive").model_dump())


async def ready(services: Services, request: Request) -> Response:
    if services.generations.draining:
        return error_response(ShuttingDown("the server is shutting down", retry_after=1))
    if services.ready and services.engine.is_healthy:
        return JSONResponse(Ready(status="ready", model=services.served_model).model_dump())
    return error_response(EngineUnavailable("the engine is not ready", retry_after=5))


async def models(services: Services, request: Request) -> Response:
    """The served model and its adapters, those the caller's tenant may use."""
    usable = services.planner.models(services.planner.tenant_of(context_of(request)))
    info = services.engine.model
    card = ModelCard(
        id=services.served_model,
        created=services.started,
        root=info.path,
        max_model_len=info.max_model_len,
    )
    adapters = [
        card.model_copy(update={"id": name, "root": path, "parent": card.id})
        for name, path in info.adapters.items()
    ]
    cards = [c for c in (card, *adapters) if c.id in usable]
    return JSONResponse(ModelList(data=cards).model_dump())


class RuntimeLoras(Protocol):
    """LoRA adapters loaded at runtime, for vLLM's load and unload endpoints (on every replica
    that shares the state, `server.state.adapters`)."""

    async def load(self, name: str, path: str) -> None: ...

    async def unload(self, name: str) -> None: ...


async def _admin_body(services: Services, request: Request) -> Any:
    """The JSON body of a request only an admin key may make (403 for any other)."""
    tenant = services.planner.tenant_of(context_of(request))
    if not tenant.config.admin:
        raise Forbidden("loading and unloading adapters needs an admin key (tenants.NAME.admin)")
    return await read_json(request, services.edge.max_body_bytes)


async def load_lora_adapter(
    services: Services, adapters: RuntimeLoras, request: Request
) -> Response:
    """vLLM's runtime loading: the adapter served as a model from now on (on every replica
    that shares the state)."""
    body = validated(LoadLoRAAdapter, await _admin_body(services, request))
    services.note_ignored("adapters", request.url.path, body)
    name = body.lora_name
    if name == services.served_model:
        raise InvalidRequest(
            f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name"
        )
    if name in services.engine.model.adapters:
        raise InvalidRequest(
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
            param="lora_name",
        )
    # As vLLM's server answers: no adapter at the path, 404; one it cannot load, 500.
    try:
        await adapters.load(name, body.lora_path)
    except AdapterNotFound as exc:
        raise ModelNotFound(str(exc), param=exc.param) from None
    except AdapterLoadFailed as exc:
        raise AdapterLoadError(str(exc), param="lora_path") from None
    except EngineRequestError as exc:
        raise InvalidRequest(str(exc), param=exc.param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(
    services: Services, adapters: RuntimeLoras, request: Request
) -> Response:
    """New requests for the adapter get the 404 at once; those running on it finish."""
    body = validated(UnloadLoRAAdapter, await _admin_body(services, request))
    services.note_ignored("adapters", request.url.path, body)
    name = body.lora_name
    if name not in services.engine.model.adapters:
        raise ModelNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await adapters.unload(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def prometheus_metrics(services: Services, request: Request) -> Response:
    """The app's own registry (one per app: `Metrics`)."""
    services.metrics.engine_unfinished_requests.labels(services.served_model).set(
        services.engine.num_unfinished_requests()
    )
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def chat_page(services: Services, request: Request) -> Response:
    page = STATIC / "index.html"
    if not page.is_file():
        return PlainTextResponse("Sluice is running. The chat page is not installed.")
    return FileResponse(page, media_type="text/html")


async def openapi_json(services: Services, request: Request) -> Response:
    return JSONResponse(api_document(services.served))


def _health() -> Operation:
    return get("200 while the process is alive", Schema(Status))


def _ready() -> Operation:
    return get("200 when the engine is ready, else 503", Schema(Ready))


def _models() -> Operation:
    return get("the served model and its LoRA adapters", Schema(ModelList))


def _itself() -> Operation:
    return get("this document", {"type": "object"})


def _admin(summary: str, body: type[BaseModel], errors: dict[str, str]) -> Operation:
    """An operation only an admin key may call (403 for any other), answered in plain text,
    with its own error answers beside every operation's."""
    operation = post(summary, request(body), {"type": "string"})
    own = {"403": "a key that is not an admin's", **errors}
    responses = {
        status: {"description": description, "content": json_content(Schema(ErrorBody))}
        for status, description in own.items()
    }
    return {**operation, "responses": {**operation["responses"], **responses}}


def _load_lora_adapter() -> Operation:
    return _admin(
        "load a LoRA adapter, served as a model (an admin key's)",
        LoadLoRAAdapter,
        {  # as vLLM's server answers
            "404": "no adapter at `lora_path`",
            "500": "an adapter the engine cannot load (`adapter_load_failed`, with its reason)",
        },
    )


def _unload_lora_adapter() -> Operation:
    return _admin(
        "unload a LoRA adapter (an admin key's); its running requests finish",
        UnloadLoRAAdapter,
        {"404": "no adapter of that name is loaded"},
    )


# The server's own endpoints, of no API in particular.
OWN: tuple[Endpoint[None], ...] = (
    Endpoint("GET", "/", chat_page),
    Endpoint("GET", "/health", health, _health),
    Endpoint("GET", "/ready", ready, _ready),
    Endpoint("GET", "/metrics", prometheus_metrics, part="metrics"),
    Endpoint("GET", "/v1/models", models, _models),
    Endpoint("GET", "/openapi.json", openapi_json, _itself),
)
ADAPTERS: tuple[Endpoint[RuntimeLoras], ...] = (
    Endpoint("POST", "/v1/load_lora_adapter", load_lora_adapter, _load_lora_adapter, "adapters"),
    Endpoint(
        "POST", "/v1/unload_lora_adapter", unload_lora_adapter, _unload_lora_adapter, "adapters"
    ),
)

# Each API's table, joined. The chat endpoints first: Starlette tries each route in turn (a
# regex per miss), and theirs take nearly every request.
ENDPOINTS: tuple[Endpoint[Any], ...] = (
    *chat_api.ENDPOINTS,
    *anthropic.ENDPOINTS,
    *responses_api.ENDPOINTS,
    *conversations_api.ENDPOINTS,
    *OWN,
    *ADAPTERS,
    *websocket_api.ENDPOINTS,
    *batch_api.ENDPOINTS,
)


@dataclass(frozen=True, slots=True)
class Parts:
    """The app's optional parts, each with what its routes are handed after the services."""

    adapters: RuntimeLoras  # LoRA adapters loaded at runtime (vLLM's endpoints)
    responses: Responses | None = None  # OpenAI's Responses API
    conversations: Conversations | None = None  # OpenAI's Conversations API
    batches: BatchServices | None = None  # OpenAI's Batch API
    metrics: bool = False  # /metrics on the API's port (no port of its own)

    def served(self) -> frozenset[Part]:
        parts: set[Part] = {"core", "adapters"}
        if self.metrics:
            parts.add("metrics")
        if self.responses is not None:
            parts.add("responses")
        if self.conversations is not None:
            parts.add("conversations")
        if self.batches is not None:
            parts.add("batches")
        return frozenset(parts)

    def handed(self, part: Part) -> tuple[Any, ...]:
        """What the routes of `part` take after the services (its table's `Endpoint[D]` says
        the type)."""
        if part == "adapters":
            return (self.adapters,)
        if part == "responses":
            return (self.responses,)
        if part == "conversations":
            return (self.conversations,)
        if part == "batches":
            return (self.batches,)
        return ()


def routes(services: Services, parts: Parts) -> list[BaseRoute]:
    """The Starlette routes of the endpoints of `parts`, each handler handed `services` (and
    its part's own)."""
    made: list[BaseRoute] = []
    served = parts.served()
    for endpoint in ENDPOINTS:
        if endpoint.part not in served:
            continue
        handler = partial(endpoint.handler, services, *parts.handed(endpoint.part))
        if endpoint.method == "WEBSOCKET":
            made.append(WebSocketRoute(endpoint.path, handler))
        else:
            made.append(Route(endpoint.path, handler, methods=[endpoint.method]))
    return made


# The bodies of each API that may hold fields that change nothing (sluice_ignored_fields_total).
_BODIES: dict[str, tuple[type[WireModel], ...]] = {
    "chat": (ChatCompletionRequest,),
    "completions": (CompletionRequest,),
    "responses": (CreateResponse,),
    "conversations": (CreateConversation, UpdateConversation, AddItems),
    "messages": (MessagesRequest, CountTokensRequest),
    "tokenizer": (TokenizeText, TokenizeChat, Detokenize),
    "batches": (CreateBatch,),
    "adapters": (LoadLoRAAdapter, UnloadLoRAAdapter),
}


@functools.cache
def ignorable_fields() -> dict[str, frozenset[str]]:
    """By API, the fields its bodies declare to change nothing: the names the count of ignored
    fields labels as they are (any other is "other")."""
    return {
        api: frozenset().union(*(ignorable_paths(body) for body in bodies))
        for api, bodies in _BODIES.items()
    }


@functools.cache
def api_document(parts: frozenset[str]) -> dict[str, Any]:
    """The OpenAPI document of the endpoints of `parts` (built once a process)."""
    return openapi.document(
        (
            (e.method, e.path, e.operation)
            for e in ENDPOINTS
            if e.operation is not None and e.part in parts
        ),
        VERSION,
    )
