"""Conversations made, read, changed and deleted for their tenant, and a response's turn in one:
held from the response's start (`begin`) to its end (`finish`), when its input and output are
added together. The holds of this process are renewed here, every third of their lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from server.conversations_api.store import (
    ConversationRow,
    ConversationStore,
    Hold,
    Page,
    StoredItem,
    no_conversation,
)
from server.conversations_api.wire import (
    AddItems,
    CreateConversation,
    ItemQuery,
    ListItems,
    conversation_object,
    deleted_object,
    item_list,
    shown,
)
from server.core.errors import PayloadTooLarge, ResourceNotFound, StoreUnavailable
from server.core.ids import new_id
from server.openai_wire.items import InputItem, chat_messages, read_items

logger = logging.getLogger("sluice.conversations")


@dataclass(frozen=True, slots=True)
class Turn:
    """A response's turn in a conversation: its hold, the items the conversation held when it
    began, and its input as the conversation will hold it (each with an id of its own)."""

    hold: Hold
    earlier: list[dict[str, Any]]
    items: list[StoredItem]

    @property
    def conversation_id(self) -> str:
        return self.hold.conversation_id

    def messages(self) -> list[dict[str, Any]]:
        """The conversation before it, as chat messages."""
        return chat_messages(read_items(self.earlier))

    def kept(self) -> dict[str, Any]:
        """As a stored response keeps it (another replica may end the response)."""
        hold = self.hold
        return {
            "tenant": hold.tenant,
            "conversation": hold.conversation_id,
            "holder": hold.holder,
            "items": [[item.id, item.body.decode()] for item in self.items],
        }

    @staticmethod
    def read(kept: dict[str, Any]) -> Turn:
        hold = Hold(kept["tenant"], kept["conversation"], kept["holder"])
        return Turn(hold, [], [StoredItem(i, body.encode()) for i, body in kept["items"]])


@dataclass(slots=True)
class Conversations:
    """See the module's docstring. `lease_s`: how long a hold outlives its holder's last
    renewal (`state.lease_seconds`)."""

    store: ConversationStore
    max_item_bytes: int
    lease_s: float
    held: dict[str, Turn] = field(default_factory=dict)  # this process's, by holder
    _renewing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._renewing = asyncio.create_task(self._renew())

    async def stop(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
        await self.store.close()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            holds = [turn.hold for turn in self.held.values()]
            if holds:
                try:
                    await self.store.renew(holds, self.lease_s)
                except StoreUnavailable:
                    logger.warning("the conversations' store did not renew %d hold(s)", len(holds))

    # -- the Conversations API --------------------------------------------------------------

    async def create(self, tenant: str, body: CreateConversation) -> dict[str, Any]:
        row = ConversationRow(new_id("conversation"), int(time.time()), body.metadata or {})
        await self.store.create(tenant, row, self._listed(body.items or (), "items"))
        return conversation_object(row)

    async def get(self, tenant: str, conversation_id: str) -> dict[str, Any]:
        row = await self.store.get(tenant, conversation_id)
        if row is None:
            raise no_conversation(conversation_id)
        return conversation_object(row)

    async def update(
        self, tenant: str, conversation_id: str, metadata: dict[str, str] | None
    ) -> dict[str, Any]:
        row = await self.store.set_metadata(tenant, conversation_id, metadata or {})
        if row is None:
            raise no_conversation(conversation_id)
        return conversation_object(row)

    async def delete(self, tenant: str, conversation_id: str) -> dict[str, Any]:
        if not await self.store.delete(tenant, conversation_id):
            raise no_conversation(conversation_id)
        return deleted_object(conversation_id)

    async def add(
        self, tenant: str, conversation_id: str, body: AddItems, query: ItemQuery
    ) -> dict[str, Any]:
        items = self._listed(body.items, "items")
        if not await self.store.add(tenant, conversation_id, items):
            raise no_conversation(conversation_id)
        return item_list([shown(orjson.loads(i.body), query.logprobs) for i in items], False)

    async def items(self, tenant: str, conversation_id: str, query: ListItems) -> dict[str, Any]:
        page = Page(query.after, query.limit, query.order == "desc")
        found = await self.store.page(tenant, conversation_id, page)
        if found is None:
            raise no_conversation(conversation_id)
        bodies, more = found
        return item_list([shown(orjson.loads(body), query.logprobs) for body in bodies], more)

    async def item(
        self, tenant: str, conversation_id: str, item_id: str, query: ItemQuery
    ) -> dict[str, Any]:
        body = await self.store.item(tenant, conversation_id, item_id)
        if body is None:
            await self.get(tenant, conversation_id)  # (its 404 first, where it is the one)
            raise ResourceNotFound(f"Item with id '{item_id}' not found.", param="item_id")
        return shown(orjson.loads(body), query.logprobs)

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        deleted = await self.store.delete_item(tenant, conversation_id, item_id)
        if deleted is None:
            raise no_conversation(conversation_id)
        if not deleted:
            raise ResourceNotFound(f"Item with id '{item_id}' not found.", param="item_id")
        return await self.get(tenant, conversation_id)

    def _listed(self, items: Sequence[InputItem], param: str) -> list[StoredItem]:
        """Items as a conversation holds them, each with an id of its own. 413: one's JSON is
        over `max_item_bytes`."""
        listed = []
        for index, item in enumerate(items):
            shaped = item.listed()
            body = orjson.dumps(shaped)
            if len(body) > self.max_item_bytes:
                raise PayloadTooLarge(
                    f"'{param}[{index}]' is {len(body)} bytes as JSON, over the bound of "
                    f"{self.max_item_bytes} (conversations.max_item_bytes)",
                    param=f"{param}[{index}]",
                )
            listed.append(StoredItem(shaped["id"], body))
        return listed

    # -- a response's turn ------------------------------------------------------------------

    async def begin(self, tenant: str, conversation_id: str, input_: Sequence[InputItem]) -> Turn:
        """The conversation held for a response whose input is `input_`, until `finish`.
        404: no such conversation; 400 `conversation_locked`: another response holds it;
        `storage_limit_exceeded` or 413: the input passes a bound."""
        items = self._listed(input_, "input")
        hold = Hold(tenant, conversation_id, uuid.uuid4().hex)
        earlier = await self.store.lock(hold, self.lease_s, len(items))
        if earlier is None:
            raise ResourceNotFound(
                f"Conversation with id '{conversation_id}' not found.", param="conversation"
            )
        turn = Turn(hold, [orjson.loads(body) for body in earlier], items)
        self.held[hold.holder] = turn
        return turn

    async def finish(self, turn: Turn, output: Sequence[dict[str, Any]] | None) -> None:
        """The response ended: with its `output`, its input and output added to the
        conversation; with None (it failed, or was cancelled), nothing. The hold let go."""
        self.held.pop(turn.hold.holder, None)
        added = (
            []
            if output is None
            else [*turn.items, *(StoredItem(item["id"], orjson.dumps(item)) for item in output)]
        )
        await self.store.finish(turn.hold, added)

    def adopt(self, turn: Turn) -> Turn:
        """Renew the hold of a turn another replica began, from now: this one may end its
        response (it follows the response, and continues it if that replica stops). Renewed
        only while still its holder's: one let go, or lapsed, stays so."""
        self.held[turn.hold.holder] = turn
        return turn

    def forget(self, turn: Turn) -> None:
        """Stop renewing the turn's hold (another replica ends its response)."""
        self.held.pop(turn.hold.holder, None)
