"""Thin routes for OpenAI's Conversations API: `/v1/conversations` and a conversation's items.
Every object is its tenant's: another tenant's id is a 404, as an unknown one is."""

from __future__ import annotations

from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from server.conversations_api.service import Conversations
from server.conversations_api.wire import (
    AddItems,
    CreateConversation,
    ItemQuery,
    ListItems,
    UpdateConversation,
)
from server.http.edge import context_of
from server.http.replies import JSONResponse, read_json
from server.http.services import Services
from server.openai_wire.wire import WireModel, validated

M = TypeVar("M", bound=WireModel)
Q = TypeVar("Q", bound=ItemQuery)


def _tenant(services: Services, request: Request) -> str:
    return services.planner.tenant_of(context_of(request)).name


async def _body(services: Services, request: Request, model: type[M]) -> M:
    body = validated(model, await read_json(request, services.edge.max_body_bytes))
    route = request.scope["route"].path  # (logged: the template, not the ids)
    services.note_ignored("conversations", f"{request.method} {route}", body)
    return body


def _query(request: Request, model: type[Q]) -> Q:
    params = request.query_params
    include = params.getlist("include") + params.getlist("include[]")
    return validated(model, model.of(params, include))


async def create_conversation(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    body = await _body(services, request, CreateConversation)
    return JSONResponse(await conversations.create(tenant, body))


async def get_conversation(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    return JSONResponse(await conversations.get(tenant, request.path_params["id"]))


async def update_conversation(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    body = await _body(services, request, UpdateConversation)
    return JSONResponse(
        await conversations.update(tenant, request.path_params["id"], body.metadata)
    )


async def delete_conversation(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    return JSONResponse(await conversations.delete(tenant, request.path_params["id"]))


async def add_items(services: Services, conversations: Conversations, request: Request) -> Response:
    tenant = _tenant(services, request)
    query = _query(request, ItemQuery)
    body = await _body(services, request, AddItems)
    return JSONResponse(await conversations.add(tenant, request.path_params["id"], body, query))


async def list_items(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    query = _query(request, ListItems)
    return JSONResponse(await conversations.items(tenant, request.path_params["id"], query))


async def get_item(services: Services, conversations: Conversations, request: Request) -> Response:
    tenant = _tenant(services, request)
    query = _query(request, ItemQuery)
    path = request.path_params
    return JSONResponse(await conversations.item(tenant, path["id"], path["item_id"], query))


async def delete_item(
    services: Services, conversations: Conversations, request: Request
) -> Response:
    tenant = _tenant(services, request)
    path = request.path_params
    return JSONResponse(await conversations.delete_item(tenant, path["id"], path["item_id"]))
