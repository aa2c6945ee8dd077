"""Conversations kept for their tenant until deleted: the port (`ConversationStore`), which
SQLite implements here, under the data directory (`SqliteConversations`), and Redis with
`state.url` (`server.state.conversations`), and the words both answer with.

A conversation is its object (`ConversationRow`) and its items in the order they came, each an
id and its JSON as OpenAI lists it. A response on a conversation holds it (`lock`) from its
start to its end (`finish`), a lease its holder renews: another response, or a client's change
to its items, is then refused (`ConversationLocked`), and the response's input and output are
added at its end as one change, after what the conversation held when it began. A holder
that dies lets go when its lease lapses. The tenant's bounds (`Limits`) are checked as a
client adds items and as a response begins; a response's items at its end are never refused.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from server.core.errors import ConversationLocked, ResourceNotFound, StorageLimitExceeded
from server.core.sqlite import SqliteDatabase

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    tenant TEXT NOT NULL, id TEXT NOT NULL, created_at INTEGER NOT NULL, metadata TEXT NOT NULL,
    next_seq INTEGER NOT NULL, holder TEXT, until REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, id));
CREATE TABLE IF NOT EXISTS items (
    tenant TEXT NOT NULL, conversation TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL,
    body BLOB NOT NULL, PRIMARY KEY (tenant, conversation, seq));
CREATE UNIQUE INDEX IF NOT EXISTS items_by_id ON items (tenant, conversation, id);
"""


@dataclass(frozen=True, slots=True)
class ConversationRow:
    id: str
    created_at: int
    metadata: dict[str, str]


@dataclass(frozen=True, slots=True)
class StoredItem:
    id: str
    body: bytes  # its JSON, as OpenAI lists it


@dataclass(frozen=True, slots=True)
class Limits:
    """Each tenant's bounds (`conversations.*` in the configuration)."""

    max_conversations: int
    max_items: int


@dataclass(frozen=True, slots=True)
class Page:
    """Items to list: those after `after` (an item's id) in the order asked, `limit` at most."""

    after: str | None
    limit: int
    descending: bool


@dataclass(frozen=True, slots=True)
class Hold:
    """A response's hold on a conversation."""

    tenant: str
    conversation_id: str
    holder: str


class ConversationStore(Protocol):
    """Every call may raise `StoreUnavailable` (Redis did not answer): nothing was changed."""

    async def create(
        self, tenant: str, conversation: ConversationRow, items: Sequence[StoredItem]
    ) -> None:
        """StorageLimitExceeded: the tenant's conversations or items are at their bound."""

    async def get(self, tenant: str, conversation_id: str) -> ConversationRow | None: ...

    async def set_metadata(
        self, tenant: str, conversation_id: str, metadata: dict[str, str]
    ) -> ConversationRow | None: ...

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        """The conversation and its items gone (a hold on it with them); False: none."""

    async def add(self, tenant: str, conversation_id: str, items: Sequence[StoredItem]) -> bool:
        """A client's items after the others; False: no such conversation.
        ConversationLocked, StorageLimitExceeded."""

    async def page(
        self, tenant: str, conversation_id: str, page: Page
    ) -> tuple[list[bytes], bool] | None:
        """The items of `page` and whether more follow; None: no such conversation.
        ResourceNotFound: `page.after` names no item of it."""

    async def item(self, tenant: str, conversation_id: str, item_id: str) -> bytes | None: ...

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool | None:
        """False: no such item; None: no such conversation. ConversationLocked."""

    async def lock(self, hold: Hold, lease_s: float, adding: int) -> list[bytes] | None:
        """The conversation held by `hold.holder` for `lease_s`, and its items; None: no such
        conversation. ConversationLocked: another holds it. StorageLimitExceeded: `adding`
        items more would pass the tenant's bound."""

    async def finish(self, hold: Hold, items: Sequence[StoredItem]) -> None:
        """A response's `items` after the others, whatever the bounds, and the conversation let
        go if `hold` still holds it; nothing if it was deleted meanwhile. Once: items already
        there (the first one's id) are not added again, as when the replica that ran a response
        and another that followed it both end it."""

    async def renew(self, holds: Sequence[Hold], lease_s: float) -> None:
        """Each hold still its holder's, renewed for `lease_s`."""

    async def close(self) -> None: ...


def no_conversation(conversation_id: str) -> ResourceNotFound:
    """The 404 an unknown conversation, a deleted one and another tenant's all get."""
    return ResourceNotFound(
        f"Conversation with id '{conversation_id}' not found.", param="conversation_id"
    )


def locked() -> ConversationLocked:
    return ConversationLocked(
        "Another process is currently operating on this conversation. Please retry in a few "
        "seconds.",
        param="conversation",
    )


def too_many_conversations(tenant: str, limits: Limits) -> StorageLimitExceeded:
    return StorageLimitExceeded(
        f"tenant '{tenant}' holds {limits.max_conversations} conversations, its bound "
        "(conversations.max_conversations): delete one first"
    )


def too_many_items(tenant: str, adding: int, limits: Limits) -> StorageLimitExceeded:
    return StorageLimitExceeded(
        f"{adding} item(s) more would pass tenant '{tenant}''s bound of {limits.max_items} items "
        "in its conversations (conversations.max_items): delete some first",
        param="items",
    )


def no_item_after(item_id: str) -> ResourceNotFound:
    return ResourceNotFound(f"no item '{item_id}' in the conversation", param="after")


def row_of(conversation_id: str, created_at: Any, metadata: Any) -> ConversationRow:
    return ConversationRow(conversation_id, int(created_at), orjson.loads(metadata))


class SqliteConversations:
    """`ConversationStore` in `directory/conversations.sqlite3` (in memory with no directory),
    its calls on threads of its own (`SqliteDatabase`): each change one transaction, so
    processes sharing the directory share the conversations, holds and all. `clock`: the
    holds' (wall) clock, which every process of the host shares."""

    def __init__(
        self, directory: Path | None, limits: Limits, clock: Callable[[], float] = time.time
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._sql = SqliteDatabase.under(directory, "conversations.sqlite3", SCHEMA)

    async def close(self) -> None:
        self._sql.close()

    async def create(
        self, tenant: str, conversation: ConversationRow, items: Sequence[StoredItem]
    ) -> None:
        await self._sql.transaction(self._create, tenant, conversation, items)

    def _create(
        self,
        db: sqlite3.Connection,
        tenant: str,
        conversation: ConversationRow,
        items: Sequence[StoredItem],
    ) -> None:
        (held,) = db.execute(
            "SELECT COUNT(*) FROM conversations WHERE tenant = ?", (tenant,)
        ).fetchone()
        if held >= self.limits.max_conversations:
            raise too_many_conversations(tenant, self.limits)
        self._check_room(db, tenant, len(items))
        db.execute(
            "INSERT INTO conversations (tenant, id, created_at, metadata, next_seq) "
            "VALUES (?, ?, ?, ?, 0)",
            (tenant, conversation.id, conversation.created_at, orjson.dumps(conversation.metadata)),
        )
        _append(db, tenant, conversation.id, 0, items)

    def _check_room(self, db: sqlite3.Connection, tenant: str, adding: int) -> None:
        (held,) = db.execute("SELECT COUNT(*) FROM items WHERE tenant = ?", (tenant,)).fetchone()
        if held + adding > self.limits.max_items:
            raise too_many_items(tenant, adding, self.limits)

    async def get(self, tenant: str, conversation_id: str) -> ConversationRow | None:
        return await self._sql.read(_row, tenant, conversation_id)

    async def set_metadata(
        self, tenant: str, conversation_id: str, metadata: dict[str, str]
    ) -> ConversationRow | None:
        return await self._sql.transaction(_set_metadata, tenant, conversation_id, metadata)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        return await self._sql.transaction(_delete, tenant, conversation_id)

    async def add(self, tenant: str, conversation_id: str, items: Sequence[StoredItem]) -> bool:
        return await self._sql.transaction(self._add, tenant, conversation_id, items)

    def _add(
        self,
        db: sqlite3.Connection,
        tenant: str,
        conversation_id: str,
        items: Sequence[StoredItem],
    ) -> bool:
        found = self._unheld(db, tenant, conversation_id)
        if found is None:
            return False
        self._check_room(db, tenant, len(items))
        _append(db, tenant, conversation_id, found, items)
        return True

    def _unheld(self, db: sqlite3.Connection, tenant: str, conversation_id: str) -> int | None:
        """The conversation's next sequence number; None: no such conversation.
        ConversationLocked: a response holds it."""
        found = db.execute(
            "SELECT next_seq, holder, until FROM conversations WHERE tenant = ? AND id = ?",
            (tenant, conversation_id),
        ).fetchone()
        if found is None:
            return None
        next_seq, holder, until = found
        if holder is not None and until > self._clock():
            raise locked()
        return int(next_seq)

    async def page(
        self, tenant: str, conversation_id: str, page: Page
    ) -> tuple[list[bytes], bool] | None:
        return await self._sql.read(_page, tenant, conversation_id, page)

    async def item(self, tenant: str, conversation_id: str, item_id: str) -> bytes | None:
        found = await self._sql.read(
            lambda db: db.execute(
                "SELECT body FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
                (tenant, conversation_id, item_id),
            ).fetchone()
        )
        return None if found is None else bytes(found[0])

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool | None:
        return await self._sql.transaction(self._delete_item, tenant, conversation_id, item_id)

    def _delete_item(
        self, db: sqlite3.Connection, tenant: str, conversation_id: str, item_id: str
    ) -> bool | None:
        if self._unheld(db, tenant, conversation_id) is None:
            return None
        deleted = db.execute(
            "DELETE FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
            (tenant, conversation_id, item_id),
        )
        return deleted.rowcount > 0

    async def lock(self, hold: Hold, lease_s: float, adding: int) -> list[bytes] | None:
        return await self._sql.transaction(self._lock, hold, lease_s, adding)

    def _lock(
        self, db: sqlite3.Connection, hold: Hold, lease_s: float, adding: int
    ) -> list[bytes] | None:
        if self._unheld(db, hold.tenant, hold.conversation_id) is None:
            return None
        self._check_room(db, hold.tenant, adding)
        db.execute(
            "UPDATE conversations SET holder = ?, until = ? WHERE tenant = ? AND id = ?",
            (hold.holder, self._clock() + lease_s, hold.tenant, hold.conversation_id),
        )
        rows = db.execute(
            "SELECT body FROM items WHERE tenant = ? AND conversation = ? ORDER BY seq",
            (hold.tenant, hold.conversation_id),
        )
        return [bytes(body) for (body,) in rows]

    async def finish(self, hold: Hold, items: Sequence[StoredItem]) -> None:
        await self._sql.transaction(_finish, hold, items)

    async def renew(self, holds: Sequence[Hold], lease_s: float) -> None:
        until = self._clock() + lease_s
        await self._sql.transaction(
            lambda db: db.executemany(
                "UPDATE conversations SET until = ? WHERE tenant = ? AND id = ? AND holder = ?",
                [(until, h.tenant, h.conversation_id, h.holder) for h in holds],
            )
        )


def _row(db: sqlite3.Connection, tenant: str, conversation_id: str) -> ConversationRow | None:
    found = db.execute(
        "SELECT created_at, metadata FROM conversations WHERE tenant = ? AND id = ?",
        (tenant, conversation_id),
    ).fetchone()
    return None if found is None else row_of(conversation_id, *found)


def _set_metadata(
    db: sqlite3.Connection, tenant: str, conversation_id: str, metadata: dict[str, str]
) -> ConversationRow | None:
    db.execute(
        "UPDATE conversations SET metadata = ? WHERE tenant = ? AND id = ?",
        (orjson.dumps(metadata), tenant, conversation_id),
    )
    return _row(db, tenant, conversation_id)


def _delete(db: sqlite3.Connection, tenant: str, conversation_id: str) -> bool:
    db.execute("DELETE FROM items WHERE tenant = ? AND conversation = ?", (tenant, conversation_id))
    deleted = db.execute(
        "DELETE FROM conversations WHERE tenant = ? AND id = ?", (tenant, conversation_id)
    )
    return deleted.rowcount > 0


def _append(
    db: sqlite3.Connection,
    tenant: str,
    conversation_id: str,
    next_seq: int,
    items: Sequence[StoredItem],
) -> None:
    db.executemany(
        "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
        [
            (tenant, conversation_id, next_seq + i, item.id, item.body)
            for i, item in enumerate(items)
        ],
    )
    db.execute(
        "UPDATE conversations SET next_seq = ? WHERE tenant = ? AND id = ?",
        (next_seq + len(items), tenant, conversation_id),
    )


def _has(db: sqlite3.Connection, tenant: str, conversation_id: str, item_id: str) -> bool:
    return (
        db.execute(
            "SELECT 1 FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
            (tenant, conversation_id, item_id),
        ).fetchone()
        is not None
    )


def _finish(db: sqlite3.Connection, hold: Hold, items: Sequence[StoredItem]) -> None:
    tenant, conversation_id = hold.tenant, hold.conversation_id
    found = db.execute(
        "SELECT next_seq FROM conversations WHERE tenant = ? AND id = ?",
        (tenant, conversation_id),
    ).fetchone()
    if found is None:
        return  # deleted meanwhile: its items with it
    if not items or not _has(db, tenant, conversation_id, items[0].id):
        _append(db, tenant, conversation_id, int(found[0]), items)
    db.execute(
        "UPDATE conversations SET holder = NULL, until = 0 "
        "WHERE tenant = ? AND id = ? AND holder = ?",
        (tenant, conversation_id, hold.holder),
    )


def _page(
    db: sqlite3.Connection, tenant: str, conversation_id: str, page: Page
) -> tuple[list[bytes], bool] | None:
    if _row(db, tenant, conversation_id) is None:
        return None
    where, args = "", [tenant, conversation_id]
    if page.after is not None:
        found = db.execute(
            "SELECT seq FROM items WHERE tenant = ? AND conversation = ? AND id = ?",
            (tenant, conversation_id, page.after),
        ).fetchone()
        if found is None:
            raise no_item_after(page.after)
        where = f"AND seq {'<' if page.descending else '>'} ?"
        args.append(found[0])
    order = "DESC" if page.descending else "ASC"
    rows = db.execute(
        f"SELECT body FROM items WHERE tenant = ? AND conversation = ? {where} "
        f"ORDER BY seq {order} LIMIT ?",
        (*args, page.limit + 1),
    ).fetchall()
    return [bytes(body) for (body,) in rows[: page.limit]], len(rows) > page.limit
