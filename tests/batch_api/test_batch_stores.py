"""The Batch API's store, as every implementation keeps it (`BatchStore`): SQLite's, two
connections on one data directory standing for two processes of a host, and Redis's, two
`RedisState`s on a real `redis-server` standing for two replicas. What a runner relies on:
one owner at a time, a lapsed lease taken over, a cancel made elsewhere seen at renewal, a
line written once, a batch finalized once; and files and batches scoped by tenant."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import Clock, RedisProcess, redis_replicas

from server.batch_api.sqlite_store import SqliteBatchStore
from server.batch_api.store import PAGE_LINES, Batch, BatchStore, Line, read_all
from server.state.batches import RedisBatchStore

REDIS_LEASE_S = 0.5  # Redis's clock: real time passes for a lease to lapse


@dataclass
class Stores:
    """Two handles on one store (two processes, or two replicas), the lease they take, and
    how a lease is made to lapse."""

    first: BatchStore
    second: BatchStore
    lease_s: float
    lapse: Callable[[], Awaitable[None]]


@pytest.fixture(scope="module")
def stores_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A Redis of these tests' own. Not the session's: the servers on that one run Batch API
    runners, and a runner claims any batch whose lease lapsed, these tests' included."""
    with RedisProcess(tmp_path_factory.mktemp("stores-redis")) as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.system)])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    if request.param == "sqlite":
        clock = Clock()
        first = SqliteBatchStore(tmp_path / "data", clock)
        second = SqliteBatchStore(tmp_path / "data", clock)

        async def advance() -> None:
            clock.now += 11

        yield Stores(first, second, 10.0, advance)
        await first.close()
        await second.close()
        return
    redis: RedisProcess = request.getfixturevalue("stores_redis")

    async def wait() -> None:
        await asyncio.sleep(REDIS_LEASE_S * 1.5)  # Redis expires the claim by its own clock

    async with redis_replicas(redis, REDIS_LEASE_S) as (one, two):
        yield Stores(RedisBatchStore(one), RedisBatchStore(two), REDIS_LEASE_S, wait)


def a_batch(tenant: str | None = None, lines: int = 3) -> tuple[Batch, list[Line]]:
    """A batch in progress, of a tenant of its own unless named (Redis is the module's)."""
    now = int(time.time())
    tenant = tenant or f"acme-{uuid.uuid4().hex}"
    batch = Batch(
        id=f"batch_{uuid.uuid4().hex}",
        tenant=tenant,
        input_file_id="file-x",
        endpoint="/v1/chat/completions",
        completion_window="24h",
        created_at=now,
        expires_at=now + 86400,
        status="in_progress",
    )
    batch.request_counts["total"] = lines
    return batch, [Line(i, f"req-{i}", {"messages": [], "n": i}) for i in range(lines)]


async def test_one_owner_at_a_time_and_a_lapsed_lease_is_taken_over(stores: Stores) -> None:
    batch, lines = a_batch()
    await stores.first.add_batch(batch, lines)
    assert batch.id in await stores.second.claimable("B")
    claimed = await stores.first.claim(batch.id, "A", stores.lease_s)
    assert claimed is not None and claimed.status == "in_progress"
    assert await stores.second.claim(batch.id, "B", stores.lease_s) is None
    assert batch.id not in await stores.second.claimable("B")
    assert await stores.first.renew("A", [batch.id], stores.lease_s) == {batch.id: "in_progress"}
    await stores.lapse()  # A stopped renewing: died
    assert batch.id in await stores.second.claimable("B")
    taken = await stores.second.claim(batch.id, "B", stores.lease_s)
    assert taken is not None
    assert [line.custom_id for line in await stores.second.pending(batch.id, 10)] == [
        "req-0",
        "req-1",
        "req-2",
    ]
    # A, back from a stall, learns that the batch is no longer its own.
    assert await stores.first.renew("A", [batch.id], stores.lease_s) == {}
    # Let go, it is another's at once.
    await stores.second.release(batch.id, "B")
    assert await stores.first.claim(batch.id, "A", stores.lease_s) is not None


async def test_a_cancel_made_elsewhere_reaches_the_owner_when_it_renews(stores: Stores) -> None:
    batch, lines = a_batch()
    await stores.first.add_batch(batch, lines)
    assert await stores.first.claim(batch.id, "A", stores.lease_s) is not None
    assert await stores.second.cancel("beta", batch.id, 5) is None  # another tenant's
    cancelled = await stores.second.cancel(batch.tenant, batch.id, 5)
    assert cancelled is not None and cancelled.status == "cancelling"
    assert cancelled.times["cancelling"] == 5
    assert await stores.first.renew("A", [batch.id], stores.lease_s) == {batch.id: "cancelling"}
    # A line the owner finishes meanwhile answers the batch as it now is.
    after = await stores.first.finish_line(batch.id, 0, "done", {"custom_id": "req-0"})
    assert after.status == "cancelling" and after.request_counts["completed"] == 1
    ended = await stores.first.finalize(batch.id, "completed", 9)
    assert ended.status == "cancelled" and ended.times["cancelled"] == 9
    again = await stores.second.cancel(batch.tenant, batch.id, 10)
    assert again is not None and again.status == "cancelled"  # left as it was


async def test_a_line_is_written_once(stores: Stores) -> None:
    batch, lines = a_batch()
    await stores.first.add_batch(batch, lines)
    first = await stores.first.finish_line(batch.id, 1, "done", {"custom_id": "req-1", "n": 1})
    # The same line, finished again by a runner that had lost its claim: left as it is.
    second = await stores.second.finish_line(batch.id, 1, "done", {"custom_id": "req-1", "n": 2})
    assert (
        first.request_counts
        == second.request_counts
        == {
            "total": 3,
            "completed": 1,
            "failed": 0,
        }
    )
    failed = await stores.second.finish_line(batch.id, 0, "failed", {"custom_id": "req-0"})
    assert failed.request_counts["failed"] == 1
    assert [line.index for line in await stores.first.pending(batch.id, 10)] == [2]
    assert await stores.first.pending(batch.id, 10, skip=[2]) == []
    stored = await stores.second.batch(batch.tenant, batch.id)
    assert stored is not None and stored.request_counts == failed.request_counts
    await stores.first.finish_line(batch.id, 2, "done", {"custom_id": "req-2", "n": 3})
    ended = await stores.first.finalize(batch.id, "completed", 9)
    assert ended.output_file_id is not None
    output = await stores.second.file_content(batch.tenant, ended.output_file_id)
    assert output is not None
    assert [json.loads(r)["n"] for r in (await read_all(output)).splitlines()] == [1, 3]


async def test_a_batch_is_finalized_once_with_its_files(stores: Stores) -> None:
    batch, lines = a_batch(lines=1)
    await stores.first.add_batch(batch, lines)
    assert await stores.first.claim(batch.id, "A", stores.lease_s) is not None
    await stores.first.finish_line(batch.id, 0, "done", {"custom_id": "req-0"})
    ended = await stores.first.finalize(batch.id, "completed", 7)
    assert ended.status == "completed" and ended.times["finalizing"] == 7
    assert ended.output_file_id is not None and ended.error_file_id is None
    content = await stores.second.file_content(batch.tenant, ended.output_file_id)
    assert content is not None and await read_all(content) == b'{"custom_id": "req-0"}\n'
    # Finalized again (a runner that had lost its claim): nothing changes, no second file.
    again = await stores.second.finalize(batch.id, "completed", 8)
    assert again.output_file_id == ended.output_file_id and again.times["completed"] == 7
    outputs = await stores.second.files(batch.tenant, "batch_output")
    assert [f["id"] for f in outputs] == [ended.output_file_id]
    assert batch.id not in await stores.second.claimable("B")
    assert await stores.second.claim(batch.id, "B", stores.lease_s) is None
    assert "completed" in await stores.second.statuses()


async def test_a_batch_s_files_are_its_results_in_order_read_a_page_at_a_time(
    stores: Stores,
) -> None:
    lines = 2 * PAGE_LINES + 5
    batch, made = a_batch(lines=lines)
    await stores.first.add_batch(batch, made)
    states = ["done", "failed", "done", "expired"]
    for line in reversed(made):  # written out of order, read in the lines' order
        state = states[line.index % len(states)]
        result = {"custom_id": line.custom_id, "n": line.index, "text": "é" * (line.index % 3)}
        await stores.first.finish_line(batch.id, line.index, state, result)
    ended = await stores.first.finalize(batch.id, "completed", 5)
    assert ended.output_file_id is not None and ended.error_file_id is not None
    for file_id, kept in (
        (ended.output_file_id, {"done"}),
        (ended.error_file_id, {"failed", "expired"}),
    ):
        content = await stores.second.file_content(batch.tenant, file_id)
        assert content is not None
        chunks = [chunk async for chunk in content]
        assert len(chunks) > 1  # streamed, not built whole
        data = b"".join(chunks)
        file = await stores.second.file(batch.tenant, file_id)
        assert file is not None and file["bytes"] == len(data)
        wanted = [i for i in range(lines) if states[i % len(states)] in kept]
        assert [json.loads(row)["n"] for row in data.splitlines()] == wanted
    # Deleted, the file is gone; the batch's lines are not (the other file still reads).
    assert await stores.second.delete_file(batch.tenant, ended.output_file_id)
    assert await stores.first.file_content(batch.tenant, ended.output_file_id) is None
    assert await stores.first.file_content(batch.tenant, ended.error_file_id) is not None


async def test_files_and_batches_belong_to_their_tenant(stores: Stores) -> None:
    content = b'{"a": 1}\n\xff\xfe not UTF-8\n'
    file = await stores.first.add_file("acme", "batch", "in.jsonl", content)
    assert file["bytes"] == len(content) and file["object"] == "file"
    assert await stores.second.file("acme", file["id"]) == file
    stored = await stores.second.file_content("acme", file["id"])
    assert stored is not None and await read_all(stored) == content
    assert file["id"] in {f["id"] for f in await stores.second.files("acme", "batch")}
    assert await stores.second.file("beta", file["id"]) is None
    assert await stores.second.file_content("beta", file["id"]) is None
    assert not await stores.second.delete_file("beta", file["id"])
    assert await stores.second.delete_file("acme", file["id"])
    assert await stores.first.file("acme", file["id"]) is None
    tenant = f"acme-{uuid.uuid4().hex}"  # (a tenant of its own, as in `a_batch`)
    made = []
    for _ in range(3):
        batch, lines = a_batch(tenant, lines=1)
        await stores.first.add_batch(batch, lines)
        made.append(batch.id)
    page, more = await stores.second.batches(tenant, None, 2)
    assert [b.id for b in page] == made[::-1][:2] and more
    page, more = await stores.second.batches(tenant, made[1], 2)
    assert [b.id for b in page] == [made[0]] and not more
    assert await stores.second.batch("beta", made[0]) is None
    assert await stores.second.batches("beta", None, 10) == ([], False)


async def test_a_sqlite_store_made_before_the_status_column_claims_and_result_files_opens(
    tmp_path: Path,
) -> None:
    import sqlite3

    batch, _ = a_batch()
    (tmp_path / "data").mkdir()
    with sqlite3.connect(tmp_path / "data" / "batches.sqlite3") as old:
        old.execute(
            "CREATE TABLE batches (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "seq INTEGER NOT NULL, body TEXT NOT NULL)"
        )
        old.execute(
            "INSERT INTO batches VALUES (?, ?, 1, ?)", (batch.id, batch.tenant, batch.to_row())
        )
        old.execute(
            "CREATE TABLE files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL, "
            "created_at INTEGER NOT NULL, content BLOB NOT NULL)"
        )
        old.execute(
            "INSERT INTO files VALUES ('file-old', ?, 'batch', 'in.jsonl', 3, 1, ?)",
            (batch.tenant, b"{}\n"),
        )
        old.execute(
            "CREATE TABLE lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, "
            "custom_id TEXT NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL, result TEXT, "
            "PRIMARY KEY (batch_id, idx))"
        )
        old.execute("INSERT INTO lines VALUES (?, 0, 'req-0', '{}', 'pending', NULL)", (batch.id,))
    old.close()
    store = SqliteBatchStore(tmp_path / "data", Clock())
    try:
        assert await store.statuses() == ["in_progress"]
        assert await store.claimable("me") == [batch.id]  # its claim row was made
        claimed = await store.claim(batch.id, "me", 10.0)
        assert claimed is not None and claimed.status == "in_progress"
        assert await store.cancel(batch.tenant, batch.id, 1) is not None
        assert await store.statuses() == ["cancelling"]  # the column follows the body
        uploaded = await store.file_content(batch.tenant, "file-old")
        assert uploaded is not None and await read_all(uploaded) == b"{}\n"
        await store.finish_line(batch.id, 0, "done", {"custom_id": "req-0"})
        ended = await store.finalize(batch.id, "completed", 2)  # a result file in the old table
        assert ended.output_file_id is not None
        output = await store.file_content(batch.tenant, ended.output_file_id)
        assert output is not None and await read_all(output) == b'{"custom_id": "req-0"}\n'
    finally:
        await store.close()
