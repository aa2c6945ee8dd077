"""The conversations' store, as every implementation keeps it (`ConversationStore`): SQLite's,
two connections on one data directory standing for two processes of a host, and Redis's, two
`RedisState`s on a real `redis-server` standing for two replicas. What the API relies on: items
in the order they came, pages either way from an item, a hold that keeps others out until its
end (or its lease's), the tenant's bounds, a delete that takes the items with it, and every
object scoped by tenant."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
from conftest import Clock, RedisProcess, redis_replicas

from server.conversations_api.store import (
    ConversationRow,
    ConversationStore,
    Hold,
    Limits,
    Page,
    SqliteConversations,
    StoredItem,
)
from server.core.errors import ConversationLocked, ResourceNotFound, StorageLimitExceeded
from server.state.conversations import RedisConversations

LIMITS = Limits(max_conversations=3, max_items=8)
REDIS_LEASE_S = 1.0  # Redis's clock: real time passes for a hold to lapse
DEADLINE_S = 10.0


@dataclass
class Stores:
    """Two handles on one store (two processes, or two replicas), the lease they take, and
    how 0.6 of a lease is made to pass (twice, and a hold not renewed between has lapsed)."""

    first: ConversationStore
    second: ConversationStore
    lease_s: float
    advance: Callable[[], Awaitable[None]]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.system)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    if request.param == "sqlite":
        clock = Clock()
        first = SqliteConversations(tmp_path / "data", LIMITS, clock)
        second = SqliteConversations(tmp_path / "data", LIMITS, clock)

        async def advance() -> None:
            clock.now += 6

        yield Stores(first, second, 10.0, advance)
        await first.close()
        await second.close()
        return
    redis: RedisProcess = request.getfixturevalue("session_redis")

    async def wait() -> None:
        await asyncio.sleep(REDIS_LEASE_S * 0.6)  # Redis expires a hold by its own clock

    async with redis_replicas(redis, REDIS_LEASE_S) as (one, two):
        first, second = RedisConversations(one, LIMITS), RedisConversations(two, LIMITS)
        yield Stores(first, second, REDIS_LEASE_S, wait)


def tenant() -> str:
    """A tenant of the test's own (Redis is the session's)."""
    return f"acme-{uuid.uuid4().hex}"


def items(*texts: str) -> list[StoredItem]:
    made = []
    for text in texts:
        item_id = f"msg_{uuid.uuid4().hex}"
        made.append(StoredItem(item_id, orjson.dumps({"id": item_id, "text": text})))
    return made


async def made(store: ConversationStore, owner: str, *texts: str) -> str:
    conversation_id = f"conv_{uuid.uuid4().hex}"
    row = ConversationRow(conversation_id, int(time.time()), {"k": "v"})
    await store.create(owner, row, items(*texts))
    return conversation_id


def read(bodies: list[bytes]) -> list[str]:
    return [orjson.loads(body)["text"] for body in bodies]


async def page(
    store: ConversationStore, owner: str, conversation_id: str, **how: object
) -> tuple[list[str], bool]:
    found = await store.page(owner, conversation_id, Page(**how))  # type: ignore[arg-type]
    assert found is not None
    bodies, more = found
    return read(bodies), more


async def test_items_are_kept_in_order_and_paged_either_way(stores: Stores) -> None:
    store, other = stores.first, stores.second
    owner = tenant()
    conversation_id = await made(store, owner, "a", "b")
    assert await store.add(owner, conversation_id, items("c", "d", "e"))
    everything = await other.page(owner, conversation_id, Page(None, 100, False))
    assert everything is not None
    ids = [orjson.loads(body)["id"] for body in everything[0]]
    assert read(everything[0]) == ["a", "b", "c", "d", "e"] and everything[1] is False
    assert await page(other, owner, conversation_id, after=None, limit=2, descending=True) == (
        ["e", "d"],
        True,
    )
    assert await page(other, owner, conversation_id, after=ids[3], limit=2, descending=True) == (
        ["c", "b"],
        True,
    )
    assert await page(other, owner, conversation_id, after=ids[1], limit=5, descending=False) == (
        ["c", "d", "e"],
        False,
    )
    with pytest.raises(ResourceNotFound):
        await other.page(owner, conversation_id, Page("msg_none", 2, False))
    assert read([body for body in [await other.item(owner, conversation_id, ids[2])] if body]) == [
        "c"
    ]
    assert await store.delete_item(owner, conversation_id, ids[2]) is True
    assert await store.delete_item(owner, conversation_id, ids[2]) is False
    assert await other.item(owner, conversation_id, ids[2]) is None
    assert (await page(other, owner, conversation_id, after=None, limit=9, descending=False))[
        0
    ] == ["a", "b", "d", "e"]
    row = await other.set_metadata(owner, conversation_id, {"x": "y"})
    assert row is not None and row.metadata == {"x": "y"}
    assert (await store.get(owner, conversation_id)) == row


async def test_a_hold_keeps_others_out_until_its_end(stores: Stores) -> None:
    store, other = stores.first, stores.second
    owner = tenant()
    conversation_id = await made(store, owner, "a")
    hold = Hold(owner, conversation_id, "holder-1")
    earlier = await store.lock(hold, stores.lease_s * 20, 2)
    assert earlier is not None and read(earlier) == ["a"]
    for refused in (
        other.lock(Hold(owner, conversation_id, "holder-2"), stores.lease_s, 1),
        other.add(owner, conversation_id, items("x")),
        other.delete_item(owner, conversation_id, "msg_none"),
    ):
        with pytest.raises(ConversationLocked):
            await refused
    assert await other.set_metadata(owner, conversation_id, {}) is not None  # not held
    await store.finish(hold, items("q", "r"))  # its input and output, after what it saw
    assert await other.add(owner, conversation_id, items("s"))  # let go
    assert (await page(other, owner, conversation_id, after=None, limit=9, descending=False))[
        0
    ] == ["a", "q", "r", "s"]
    # A hold whose response ends with nothing adds nothing, and lets go.
    second = Hold(owner, conversation_id, "holder-2")
    assert await other.lock(second, stores.lease_s * 20, 1) is not None
    await other.finish(second, [])
    assert await store.lock(Hold(owner, conversation_id, "holder-3"), stores.lease_s, 1)


async def test_a_response_ended_by_two_replicas_adds_its_items_once(stores: Stores) -> None:
    """The replica that ran a background response and one that followed it both end it (the
    same turn, its items with the same ids): the second adds nothing, and the tenant's count
    of items stays true."""
    store, other = stores.first, stores.second
    owner = tenant()
    conversation_id = await made(store, owner, "a")
    hold = Hold(owner, conversation_id, "holder-1")
    assert await store.lock(hold, stores.lease_s * 20, 2) is not None
    turn = items("q", "r")
    await store.finish(hold, turn)
    await other.finish(hold, turn)
    assert (await page(other, owner, conversation_id, after=None, limit=9, descending=False))[
        0
    ] == ["a", "q", "r"]
    # 3 of the tenant's 8 items held: 5 more fit, a sixth does not.
    assert await other.add(owner, conversation_id, items(*"bcdef"))
    with pytest.raises(StorageLimitExceeded):
        await store.add(owner, conversation_id, items("g"))


async def test_a_hold_lapses_unless_renewed(stores: Stores) -> None:
    store, other = stores.first, stores.second
    owner = tenant()
    kept, left = await made(store, owner), await made(store, owner)
    kept_hold, left_hold = Hold(owner, kept, "kept"), Hold(owner, left, "left")
    for hold in (kept_hold, left_hold):
        assert await store.lock(hold, stores.lease_s, 0) is not None
    await stores.advance()
    await store.renew([kept_hold], stores.lease_s)
    await stores.advance()
    # The one its holder stopped renewing lapsed: another takes it; the other is still held.
    assert await other.lock(Hold(owner, left, "other"), stores.lease_s * 20, 0) is not None
    with pytest.raises(ConversationLocked):
        await other.lock(Hold(owner, kept, "other"), stores.lease_s, 0)
    # The lapsed holder's end still adds its items (nothing is lost), the new hold stays.
    await store.finish(left_hold, items("late"))
    with pytest.raises(ConversationLocked):
        await other.add(owner, left, items("x"))
    assert (await page(other, owner, left, after=None, limit=9, descending=False))[0] == ["late"]


async def test_the_tenants_bounds_are_kept_and_a_delete_frees_them(stores: Stores) -> None:
    store, other = stores.first, stores.second
    owner = tenant()
    first = await made(store, owner, *"abcde")
    second = await made(other, owner, "f", "g")
    with pytest.raises(StorageLimitExceeded):
        await other.add(owner, second, items("h", "i"))  # 9 > 8
    assert await other.add(owner, second, items("h"))  # 8
    with pytest.raises(StorageLimitExceeded):
        await store.lock(Hold(owner, second, "h"), stores.lease_s, 1)
    with pytest.raises(StorageLimitExceeded):
        await made(store, owner, "x")
    third = await made(store, owner)
    with pytest.raises(StorageLimitExceeded):
        await made(store, owner)  # 4 > 3
    # A response's items at its end are never refused (its input was checked at its start).
    hold = Hold(owner, third, "h")
    assert await store.lock(hold, stores.lease_s * 20, 0) is not None
    await store.finish(hold, items("y"))
    assert await store.delete(owner, first)  # its 5 items go with it
    assert not await store.delete(owner, first)
    assert await other.page(owner, first, Page(None, 5, False)) is None
    await made(other, owner, *"jkl")
    assert await other.add(owner, second, items("m"))  # 8 again: f g h m, y, j k l


async def test_a_conversation_deleted_while_held_takes_the_response_s_items_with_it(
    stores: Stores,
) -> None:
    owner = tenant()
    conversation_id = await made(stores.first, owner, "a")
    hold = Hold(owner, conversation_id, "h")
    assert await stores.first.lock(hold, stores.lease_s * 20, 1) is not None
    assert await stores.second.delete(owner, conversation_id)
    await stores.first.finish(hold, items("b"))  # nothing: it is gone
    assert await stores.second.get(owner, conversation_id) is None
    assert await stores.first.lock(hold, stores.lease_s, 0) is None


async def test_another_tenants_conversation_is_none_of_its_own(stores: Stores) -> None:
    owner, stranger = tenant(), tenant()
    conversation_id = await made(stores.first, owner, "a")
    other = stores.second
    bodies = await stores.first.page(owner, conversation_id, Page(None, 1, False))
    assert bodies is not None
    item_id = orjson.loads(bodies[0][0])["id"]
    assert await other.get(stranger, conversation_id) is None
    assert await other.set_metadata(stranger, conversation_id, {}) is None
    assert await other.page(stranger, conversation_id, Page(None, 5, False)) is None
    assert await other.item(stranger, conversation_id, item_id) is None
    assert not await other.add(stranger, conversation_id, items("x"))
    assert await other.delete_item(stranger, conversation_id, item_id) is None
    assert await other.lock(Hold(stranger, conversation_id, "h"), stores.lease_s, 0) is None
    assert not await other.delete(stranger, conversation_id)
    row = await other.get(owner, conversation_id)
    assert row is not None and row.metadata == {"k": "v"}
    assert (await page(other, owner, conversation_id, after=None, limit=5, descending=False))[
        0
    ] == ["a"]
