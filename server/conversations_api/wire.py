"""OpenAI's Conversations API on the wire: its bodies and query strings as models (items are
the Responses API's input items, `server.openai_wire.items`), and its objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from server.conversations_api.store import ConversationRow
from server.openai_wire.items import TEXT_LOGPROBS, InputItem, Metadata
from server.openai_wire.wire import NoEffect, OnlyDefault, WireModel

MAX_ADDED = 20  # items a create or an add takes at once (OpenAI's)

Items = Annotated[list[InputItem], Field(max_length=MAX_ADDED)]
Include = list[Annotated[str, OnlyDefault(TEXT_LOGPROBS)]]


class CreateConversation(WireModel):
    """`POST /v1/conversations`'s body."""

    items: Items | None = None
    metadata: Metadata | None = None
    safety_identifier: Annotated[str | None, NoEffect("metadata")] = None


class UpdateConversation(WireModel):
    """`POST /v1/conversations/{id}`'s body: the metadata, replaced (null: none)."""

    metadata: Metadata | None


class AddItems(WireModel):
    """`POST /v1/conversations/{id}/items`'s body."""

    items: Annotated[Items, Field(min_length=1)]


class ItemQuery(WireModel):
    """The query string of an item's reading: `include` (`include[]`, as the SDK sends it)."""

    model_config = ConfigDict(strict=False, extra="ignore")

    include: Include | None = Field(
        None, description="message.output_text.logprobs: the output text's logprobs"
    )

    @property
    def logprobs(self) -> bool:
        return TEXT_LOGPROBS in (self.include or ())

    @classmethod
    def of(cls, query: Mapping[str, str], include: list[str]) -> dict[str, Any]:
        """The query string's fields as the model reads them (`include`: its values)."""
        fields: dict[str, Any] = {k: v for k, v in query.items() if k in cls.model_fields}
        if include:
            fields["include"] = include
        return fields


class ListItems(ItemQuery):
    """`GET /v1/conversations/{id}/items`'s query string."""

    after: str | None = Field(None, description="an item's id: the items after it")
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


def conversation_object(row: ConversationRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "conversation",
        "created_at": row.created_at,
        "metadata": row.metadata,
    }


def deleted_object(conversation_id: str) -> dict[str, Any]:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def item_list(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def shown(item: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    """An item as listed: an output text's logprobs only where `include` asks for them."""
    if logprobs or item["type"] != "message":
        return item
    parts = [
        {key: value for key, value in part.items() if key != "logprobs"} for part in item["content"]
    ]
    return {**item, "content": parts}
