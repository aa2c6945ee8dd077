"""OpenAI's Conversations API's endpoints: each one's method, path, handler and OpenAPI operation.
Each handler is handed the API's `Conversations` after the services."""

from __future__ import annotations

from pydantic import RootModel

from server.conversations_api.routes import (
    add_items,
    create_conversation,
    delete_conversation,
    delete_item,
    get_conversation,
    get_item,
    list_items,
    update_conversation,
)
from server.conversations_api.service import Conversations
from server.conversations_api.wire import (
    AddItems,
    CreateConversation,
    ItemQuery,
    ListItems,
    UpdateConversation,
)
from server.http.endpoints import Endpoint
from server.http.operations import Operation, Schema, get, post, query, reply, request, with_id

_CONVERSATION, _ITEM = "a conversation id", "an item id of the conversation"


def _create() -> Operation:
    from openai.types.conversations import Conversation

    return post(
        "OpenAI's Conversations API: a conversation, with its first items",
        request(CreateConversation),
        Schema(Conversation),
    )


def _get() -> Operation:
    from openai.types.conversations import Conversation

    return get("a conversation", Schema(Conversation))


def _update() -> Operation:
    from openai.types.conversations import Conversation

    return post(
        "a conversation's metadata, replaced", request(UpdateConversation), Schema(Conversation)
    )


def _delete() -> Operation:
    from openai.types.conversations import ConversationDeletedResource

    summary = "delete a conversation and its items"
    return {
        "summary": summary,
        "responses": {"200": reply(summary, Schema(ConversationDeletedResource))},
    }


def _add_items() -> Operation:
    from openai.types.conversations import ConversationItemList

    operation = post(
        "items added after the conversation's others (20 at most)",
        request(AddItems),
        Schema(ConversationItemList),
    )
    return {**operation, "parameters": query(ItemQuery)}


def _list_items() -> Operation:
    from openai.types.conversations import ConversationItemList

    operation = get("a conversation's items, a page at a time", Schema(ConversationItemList))
    return {**operation, "parameters": query(ListItems)}


def _get_item() -> Operation:
    from openai.types.conversations import ConversationItem as Item

    class ConversationItem(RootModel[Item]):  # (a union: the document needs a model)
        pass

    return {
        **get("a conversation's item", Schema(ConversationItem)),
        "parameters": query(ItemQuery),
    }


def _delete_item() -> Operation:
    from openai.types.conversations import Conversation

    summary = "delete an item of a conversation: the conversation"
    return {"summary": summary, "responses": {"200": reply(summary, Schema(Conversation))}}


_ONE = "/v1/conversations/{id}"
_ITEMS = "/v1/conversations/{id}/items"
_AN_ITEM = "/v1/conversations/{id}/items/{item_id}"

ENDPOINTS: tuple[Endpoint[Conversations], ...] = (
    Endpoint("POST", "/v1/conversations", create_conversation, _create, "conversations"),
    Endpoint("GET", _ONE, get_conversation, with_id(_get, _CONVERSATION), "conversations"),
    Endpoint("POST", _ONE, update_conversation, with_id(_update, _CONVERSATION), "conversations"),
    Endpoint("DELETE", _ONE, delete_conversation, with_id(_delete, _CONVERSATION), "conversations"),
    Endpoint("POST", _ITEMS, add_items, with_id(_add_items, _CONVERSATION), "conversations"),
    Endpoint("GET", _ITEMS, list_items, with_id(_list_items, _CONVERSATION), "conversations"),
    Endpoint(
        "GET",
        _AN_ITEM,
        get_item,
        with_id(_get_item, _CONVERSATION, item_id=_ITEM),
        "conversations",
    ),
    Endpoint(
        "DELETE",
        _AN_ITEM,
        delete_item,
        with_id(_delete_item, _CONVERSATION, item_id=_ITEM),
        "conversations",
    ),
)
