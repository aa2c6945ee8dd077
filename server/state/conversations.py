"""The Conversations API's store in Redis (`ConversationStore`), with `state.url`: every replica
using the Redis serves the same conversations, and a response on one, on any replica, holds it.

Keys (none expires: a conversation is kept until deleted, as in SQLite), a tenant's in one hash
slot, so that each script touches one:

- `sluice:conv:{TENANT}:ID`: a conversation's hash (`created_at`, `metadata` as JSON, `seq`:
  the next item's number);
- `…:ID:order`, its items' ids by their number (a sorted set), and `…:ID:items`, each id's
  JSON (a hash);
- `…:ID:hold`, the holder of a response running on it, for `state.lease_seconds`, renewed by
  the replica that runs it;
- `sluice:convs:{TENANT}`: the tenant's counts (`conversations`, `items`), which the bounds
  are checked against.

Each change is one script. Redis unavailable, every call answers 503 `store_unavailable` and
changes nothing. Conversations outlive a restart of Redis only if it persists (AOF or RDB).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import orjson

from server.conversations_api.store import (
    ConversationRow,
    Hold,
    Limits,
    Page,
    StoredItem,
    locked,
    no_item_after,
    row_of,
    too_many_conversations,
    too_many_items,
)
from server.state.backend import RedisState, RedisStore, tenant_key

# KEYS: conversation, order, items, counts. ARGV: created at, metadata, the bounds
# (conversations, items), then each item's id and JSON. -> 1; -1, -2: a bound passed.
CREATE = """
local n = (#ARGV - 4) / 2
if tonumber(redis.call('HGET', KEYS[4], 'conversations') or '0') >= tonumber(ARGV[3]) then
  return -1
end
if tonumber(redis.call('HGET', KEYS[4], 'items') or '0') + n > tonumber(ARGV[4]) then
  return -2
end
redis.call('HSET', KEYS[1], 'created_at', ARGV[1], 'metadata', ARGV[2], 'seq', n)
for i = 1, n do
  redis.call('ZADD', KEYS[2], i - 1, ARGV[3 + 2 * i])
  redis.call('HSET', KEYS[3], ARGV[3 + 2 * i], ARGV[4 + 2 * i])
end
redis.call('HINCRBY', KEYS[4], 'conversations', 1)
redis.call('HINCRBY', KEYS[4], 'items', n)
return 1
"""

# KEYS: conversation, order, items, counts, hold. ARGV: "add" (a client's, refused while held
# or past the bound) or "finish" (a response's, once: not again if its first item is there;
# the hold let go if still its holder's), the holder, the bound on items, then each item's id
# and JSON. -> 1; 0: no conversation; -1: held; -2: the bound passed.
APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = (#ARGV - 3) / 2
if ARGV[1] == 'add' then
  if redis.call('EXISTS', KEYS[5]) == 1 then return -1 end
  if tonumber(redis.call('HGET', KEYS[4], 'items') or '0') + n > tonumber(ARGV[3]) then
    return -2
  end
elseif n > 0 and redis.call('HEXISTS', KEYS[3], ARGV[4]) == 1 then
  n = 0
end
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
for i = 1, n do
  redis.call('ZADD', KEYS[2], seq + i - 1, ARGV[2 + 2 * i])
  redis.call('HSET', KEYS[3], ARGV[2 + 2 * i], ARGV[3 + 2 * i])
end
redis.call('HSET', KEYS[1], 'seq', seq + n)
redis.call('HINCRBY', KEYS[4], 'items', n)
if ARGV[1] == 'finish' and redis.call('GET', KEYS[5]) == ARGV[2] then
  redis.call('DEL', KEYS[5])
end
return 1
"""

# KEYS: conversation, hold, counts. ARGV: holder, lease ms, items to add, the bound on items.
# -> 1: held; 0: no conversation; -1: another holds it; -2: the bound would be passed.
LOCK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if tonumber(redis.call('HGET', KEYS[3], 'items') or '0') + tonumber(ARGV[3]) > tonumber(ARGV[4])
then
  return -2
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: conversation, order, items, counts, hold. -> 1; 0: no conversation.
DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = redis.call('ZCARD', KEYS[2])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5])
redis.call('HINCRBY', KEYS[4], 'conversations', -1)
redis.call('HINCRBY', KEYS[4], 'items', -n)
return 1
"""

# KEYS: conversation, order, items, counts, hold. ARGV: the item's id.
# -> 1; 2: no such item; 0: no conversation; -1: held.
DELETE_ITEM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('EXISTS', KEYS[5]) == 1 then return -1 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 2 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[4], 'items', -1)
return 1
"""

# KEYS: conversation. ARGV: the metadata's JSON. -> created at, metadata; nil: none.
SET_METADATA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSET', KEYS[1], 'metadata', ARGV[1])
return redis.call('HMGET', KEYS[1], 'created_at', 'metadata')
"""

# KEYS: holds (one tenant's). ARGV: lease ms, then each hold's holder. Each still its
# holder's, renewed.
RENEW = """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[i + 1] then redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
end
return 0
"""


def _keys(tenant: str, conversation_id: str) -> list[str]:
    """The conversation, its order, items, the tenant's counts, and its hold."""
    conversation = tenant_key("conv", tenant, conversation_id)
    return [
        conversation,
        f"{conversation}:order",
        f"{conversation}:items",
        tenant_key("convs", tenant),
        f"{conversation}:hold",
    ]


def _pairs(items: Sequence[StoredItem]) -> list[Any]:
    return [value for item in items for value in (item.id, item.body)]


class RedisConversations(RedisStore):
    """`ConversationStore` (`server.conversations_api.store`) in the Redis of `state` (see the
    module's docstring)."""

    OPERATION = "conversations"
    NAME = "the conversations' store"

    def __init__(self, state: RedisState, limits: Limits) -> None:
        super().__init__(state)
        self.limits = limits

    async def create(
        self, tenant: str, conversation: ConversationRow, items: Sequence[StoredItem]
    ) -> None:
        keys = _keys(tenant, conversation.id)[:4]
        limits = self.limits
        metadata = orjson.dumps(conversation.metadata)
        bounds = [limits.max_conversations, limits.max_items]
        args = [conversation.created_at, metadata, *bounds, *_pairs(items)]
        done = await self._script(CREATE, keys, args)
        if done == -1:
            raise too_many_conversations(tenant, limits)
        if done == -2:
            raise too_many_items(tenant, len(items), limits)

    async def get(self, tenant: str, conversation_id: str) -> ConversationRow | None:
        key = _keys(tenant, conversation_id)[0]
        created_at, metadata = await self._call(self._client.hmget(key, "created_at", "metadata"))
        return None if created_at is None else row_of(conversation_id, created_at, metadata)

    async def set_metadata(
        self, tenant: str, conversation_id: str, metadata: dict[str, str]
    ) -> ConversationRow | None:
        key = _keys(tenant, conversation_id)[0]
        found = await self._script(SET_METADATA, [key], [orjson.dumps(metadata)])
        return None if found is None else row_of(conversation_id, *found)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        return bool(await self._script(DELETE, _keys(tenant, conversation_id), []))

    async def add(self, tenant: str, conversation_id: str, items: Sequence[StoredItem]) -> bool:
        args = ["add", "", self.limits.max_items, *_pairs(items)]
        done = await self._script(APPEND, _keys(tenant, conversation_id), args)
        if done == -1:
            raise locked()
        if done == -2:
            raise too_many_items(tenant, len(items), self.limits)
        return bool(done)

    async def page(
        self, tenant: str, conversation_id: str, page: Page
    ) -> tuple[list[bytes], bool] | None:
        conversation, order, items, _, _ = _keys(tenant, conversation_id)
        client = self._client
        exists, seq = await self._call(
            client.pipeline(transaction=False)
            .exists(conversation)
            .zscore(order, page.after or "")
            .execute()
        )
        if not exists:
            return None
        if page.after is not None and seq is None:
            raise no_item_after(page.after)
        count = page.limit + 1
        if page.descending:
            top = "+inf" if page.after is None else f"({int(seq)}"
            ids = await self._call(client.zrevrangebyscore(order, top, "-inf", 0, count))
        else:
            bottom = "-inf" if page.after is None else f"({int(seq)}"
            ids = await self._call(client.zrangebyscore(order, bottom, "+inf", 0, count))
        bodies = await self._call(client.hmget(items, ids[: page.limit])) if ids else []
        return [body.encode() for body in bodies if body is not None], len(ids) > page.limit

    async def item(self, tenant: str, conversation_id: str, item_id: str) -> bytes | None:
        body = await self._call(self._client.hget(_keys(tenant, conversation_id)[2], item_id))
        return None if body is None else body.encode()

    async def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool | None:
        done = await self._script(DELETE_ITEM, _keys(tenant, conversation_id), [item_id])
        if done == -1:
            raise locked()
        return None if done == 0 else done == 1

    async def lock(self, hold: Hold, lease_s: float, adding: int) -> list[bytes] | None:
        conversation, order, items, counts, held = _keys(hold.tenant, hold.conversation_id)
        lease_ms = int(lease_s * 1000)
        args = [hold.holder, lease_ms, adding, self.limits.max_items]
        done = await self._script(LOCK, [conversation, held, counts], args)
        if done == 0:
            return None
        if done == -1:
            raise locked()
        if done == -2:
            raise too_many_items(hold.tenant, adding, self.limits)
        # (held: no item changes until its end; a delete of it leaves fewer, or none)
        ids = await self._call(self._client.zrange(order, 0, -1))
        bodies = await self._call(self._client.hmget(items, ids)) if ids else []
        return [body.encode() for body in bodies if body is not None]

    async def finish(self, hold: Hold, items: Sequence[StoredItem]) -> None:
        args = ["finish", hold.holder, 0, *_pairs(items)]
        await self._script(APPEND, _keys(hold.tenant, hold.conversation_id), args)

    async def renew(self, holds: Sequence[Hold], lease_s: float) -> None:
        by_tenant: dict[str, list[Hold]] = defaultdict(list)
        for hold in holds:
            by_tenant[hold.tenant].append(hold)
        for tenant, held in by_tenant.items():
            keys = [_keys(tenant, hold.conversation_id)[4] for hold in held]
            args = [int(lease_s * 1000), *(hold.holder for hold in held)]
            await self._script(RENEW, keys, args)
